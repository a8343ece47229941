/* ss_dev.h - a device-copy backend: what the staging pipeline (ss_stage)
 * needs from a GPU runtime, as a vtable.
 *
 * A backend gives page-locked host memory, one ordered queue of copies (a
 * "stream"), events to learn when the copies issued before them are done,
 * and a way to order that stream after work the caller has queued on a
 * stream of its own. The CUDA backend maps these one to one onto
 * cudaHostAlloc, cudaMemcpyAsync on a dedicated stream, cudaEventRecord /
 * cudaEventSynchronize and cudaStreamWaitEvent; ss_devhost is a backend on
 * plain host memory (its stream is a thread) with which the pipeline's
 * logic is tested on machines without a GPU.
 *
 * Every entry returns 0 or a negative SS_E* / -errno code and gets the
 * vtable itself (its state is in dev->ctx). Copies are asynchronous: a
 * buffer passed to copy() must stay valid, and unmodified for a d2h copy's
 * destination, until an event recorded after it has completed.
 *
 * Thread safety: streams and events are used by one ss_stage at a time,
 * under its lock, except sync(), which it calls without the lock from
 * several threads at once: a backend must allow that.
 */
#ifndef SS_DEV_H
#define SS_DEV_H

#include <stddef.h>

typedef struct ss_dev ss_dev;

enum { SS_DEV_D2H = 0, SS_DEV_H2D = 1 };

struct ss_dev {
    void *ctx;
    const char *name; /* "cuda", "host" */
    int (*host_alloc)(const ss_dev *dev, size_t n, void **out);
    void (*host_free)(const ss_dev *dev, void *p, size_t n);
    int (*stream_new)(const ss_dev *dev, void **stream);
    void (*stream_free)(const ss_dev *dev, void *stream);
    /* Order `stream` after everything queued on `caller` so far (NULL:
     * the runtime's default stream). */
    int (*stream_after)(const ss_dev *dev, void *stream, void *caller);
    int (*event_new)(const ss_dev *dev, void **event);
    void (*event_free)(const ss_dev *dev, void *event);
    int (*copy)(const ss_dev *dev, void *dst, const void *src, size_t n,
                int kind, void *stream);
    int (*record)(const ss_dev *dev, void *event, void *stream);
    /* Wait until every copy queued before the event's last record is done
     * (at once for an event never recorded). */
    int (*sync)(const ss_dev *dev, void *event);
    /* Text of the backend's last failure (SS_EDEVICE), e.g. the runtime's
     * error string; "" if none. May be NULL. */
    void (*describe)(const ss_dev *dev, char *buf, size_t len);
};

#endif /* SS_DEV_H */
