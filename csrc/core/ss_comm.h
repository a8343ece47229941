/* ss_comm.h - an NCCL communicator for collective I/O on device buffers.
 *
 * One communicator per process group: every member calls ss_comm_new with
 * the group's size, its rank in it, its CUDA device and the same unique id
 * (made by one member with ss_comm_unique_id and sent to the others over
 * the group by the caller). The communicator owns a non-blocking stream on
 * its device. A collective is ordered after the work queued on the
 * caller's stream (an event recorded there, waited on by ours), runs on
 * ours, and the caller's stream is made to wait for it in turn, so the
 * caller sees the result in stream order without the host blocking; with
 * `wait` the call also returns only when the collective is done and its
 * asynchronous error, if any, has been checked.
 *
 * The collectives move bytes (ncclUint8): all-gather (each rank's n bytes
 * into rank order), broadcast (n bytes from root), and scatter (root's
 * nranks * n bytes, rank r's n-byte block to rank r, as one group of
 * send/recv) and gather (its mirror: every rank's n bytes into root's
 * nranks * n, so no other rank holds the whole). Buffers are device
 * pointers on the communicator's device.
 *
 * Failures return SS_EDEVICE (a CUDA or NCCL call failed; the call and the
 * library's message are in err->detail) or SS_EINVAL. After a failed
 * collective the communicator should be aborted (ss_comm_free does so
 * when NCCL reports an asynchronous error).
 *
 * Thread safety: one call at a time per communicator (NCCL's rule).
 */
#ifndef SS_COMM_H
#define SS_COMM_H

#include <stddef.h>

#include "ss_cuda.h"
#include "ss_error.h"
#include "ss_nccl.h"

typedef struct ss_comm ss_comm;

int ss_comm_unique_id(const ss_nccl *nc,
                      unsigned char id[SS_NCCL_UNIQUE_ID_BYTES],
                      ss_errinfo *err);
int ss_comm_new(ss_comm **out, const ss_nccl *nc, const ss_cuda *cu, int device,
                int nranks, int rank,
                const unsigned char id[SS_NCCL_UNIQUE_ID_BYTES],
                ss_errinfo *err);
/* Destroy (or abort, after an asynchronous error); NULL is a no-op. */
void ss_comm_free(ss_comm *c);
int ss_comm_nranks(const ss_comm *c);
int ss_comm_rank(const ss_comm *c);
int ss_comm_device(const ss_comm *c);

int ss_comm_all_gather(ss_comm *c, const void *send, void *recv, size_t n,
                       void *stream, int wait, ss_errinfo *err);
int ss_comm_broadcast(ss_comm *c, void *buf, size_t n, int root, void *stream,
                      int wait, ss_errinfo *err);
int ss_comm_scatter(ss_comm *c, const void *send, void *recv, size_t n,
                    int root, void *stream, int wait, ss_errinfo *err);
int ss_comm_gather(ss_comm *c, const void *send, void *recv, size_t n, int root,
                   void *stream, int wait, ss_errinfo *err);

#endif /* SS_COMM_H */
