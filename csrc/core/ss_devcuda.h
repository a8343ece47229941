/* ss_devcuda.h - the ss_dev backend on the CUDA runtime (an ss_cuda table
 * from ss_cuda_load).
 *
 * One backend per device ordinal. Host buffers come from cudaHostAlloc
 * (portable, page-locked); the stream is cudaStreamCreateWithFlags(non-
 * blocking) on that device; events are cudaEventCreateWithFlags(disable
 * timing); stream_after records an event on the caller's stream and makes
 * ours wait on it (cudaStreamWaitEvent), so a save sees every kernel the
 * caller queued before it. Each call first makes the device current on
 * the calling thread (pool workers are plain threads). A failing runtime
 * call returns SS_EDEVICE; describe() gives the call, the runtime's error
 * string and its code.
 *
 * Thread safety: as ss_dev.h; the last-error text is kept under a lock.
 */
#ifndef SS_DEVCUDA_H
#define SS_DEVCUDA_H

#include "ss_cuda.h"
#include "ss_dev.h"
#include "ss_error.h"

typedef struct ss_devcuda ss_devcuda;

/* The device must exist; on failure the runtime's message is in
 * err->detail (err may be NULL). */
int ss_devcuda_new(ss_devcuda **out, const ss_cuda *cu, int device,
                   ss_errinfo *err);
void ss_devcuda_free(ss_devcuda *d); /* NULL is a no-op */
const ss_dev *ss_devcuda_dev(ss_devcuda *d);

#endif /* SS_DEVCUDA_H */
