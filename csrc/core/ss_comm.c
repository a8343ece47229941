/* ss_comm.c - see ss_comm.h. */
#include "ss_comm.h"

#include <stdlib.h>
#include <string.h>

struct ss_comm {
    const ss_nccl *nc;
    const ss_cuda *cu;
    int device, nranks, rank;
    ss_ncclComm_t comm;
    ss_cudaStream_t stream;
    ss_cudaEvent_t before, after; /* caller's stream -> ours -> caller's */
    int broken;                   /* an error was seen: abort, not destroy */
};

static int cuda_fail(const ss_cuda *cu, ss_errinfo *err, const char *call,
                     ss_cudaError_t e)
{
    const char *msg = cu->cudaGetErrorString(e);
    return ss_errinfo_set(err, SS_EDEVICE, call, NULL, -1,
                          "%s: %s (CUDA error %d)", call,
                          msg ? msg : "unknown error", (int)e);
}

static int nccl_fail(const ss_nccl *nc, ss_errinfo *err, const char *call,
                     ss_ncclResult_t r)
{
    const char *msg = nc->ncclGetErrorString(r);
    return ss_errinfo_set(err, SS_EDEVICE, call, NULL, -1,
                          "%s: %s (NCCL error %d)", call,
                          msg ? msg : "unknown error", (int)r);
}

#define CU(c, expr, name)                                                      \
    do {                                                                       \
        ss_cudaError_t e_ = (expr);                                            \
        if (e_ != SS_CUDA_SUCCESS) {                                           \
            rc = cuda_fail((c), err, (name), e_);                              \
            goto out;                                                          \
        }                                                                      \
    } while (0)
#define NC(n, expr, name)                                                      \
    do {                                                                       \
        ss_ncclResult_t r_ = (expr);                                           \
        if (r_ != SS_NCCL_SUCCESS) {                                           \
            rc = nccl_fail((n), err, (name), r_);                              \
            goto out;                                                          \
        }                                                                      \
    } while (0)

int ss_comm_unique_id(const ss_nccl *nc,
                      unsigned char id[SS_NCCL_UNIQUE_ID_BYTES],
                      ss_errinfo *err)
{
    ss_ncclUniqueId u;
    int rc = 0;
    NC(nc, nc->ncclGetUniqueId(&u), "ncclGetUniqueId");
    memcpy(id, &u, SS_NCCL_UNIQUE_ID_BYTES);
out:
    return rc;
}

int ss_comm_new(ss_comm **out, const ss_nccl *nc, const ss_cuda *cu, int device,
                int nranks, int rank,
                const unsigned char id[SS_NCCL_UNIQUE_ID_BYTES],
                ss_errinfo *err)
{
    ss_comm *c = NULL;
    ss_ncclUniqueId u;
    int rc = 0;

    *out = NULL;
    if (nc == NULL || cu == NULL || device < 0 || nranks < 1 || rank < 0 ||
        rank >= nranks)
        return ss_errinfo_set(err, SS_EINVAL, "comm", NULL, -1,
                              "rank %d of %d ranks on device %d", rank, nranks,
                              device);
    c = calloc(1, sizeof *c);
    if (c == NULL)
        return ss_errinfo_set(err, SS_ENOMEM, "comm", NULL, -1, NULL);
    *c = (ss_comm){nc, cu, device, nranks, rank, NULL, NULL, NULL, NULL, 0};
    CU(cu, cu->cudaSetDevice(device), "cudaSetDevice");
    CU(cu,
       cu->cudaStreamCreateWithFlags(&c->stream, SS_CUDA_STREAM_NON_BLOCKING),
       "cudaStreamCreateWithFlags");
    CU(cu,
       cu->cudaEventCreateWithFlags(&c->before, SS_CUDA_EVENT_DISABLE_TIMING),
       "cudaEventCreateWithFlags");
    CU(cu,
       cu->cudaEventCreateWithFlags(&c->after, SS_CUDA_EVENT_DISABLE_TIMING),
       "cudaEventCreateWithFlags");
    memcpy(&u, id, SS_NCCL_UNIQUE_ID_BYTES);
    NC(nc, nc->ncclCommInitRank(&c->comm, nranks, u, rank), "ncclCommInitRank");
out:
    if (rc < 0)
        ss_comm_free(c);
    else
        *out = c;
    return rc;
}

void ss_comm_free(ss_comm *c)
{
    if (c == NULL)
        return;
    if (c->comm != NULL) {
        ss_ncclResult_t async = SS_NCCL_SUCCESS;
        if (c->broken ||
            c->nc->ncclCommGetAsyncError(c->comm, &async) != SS_NCCL_SUCCESS ||
            async != SS_NCCL_SUCCESS)
            (void)c->nc->ncclCommAbort(c->comm); /* peers may be gone */
        else
            (void)c->nc->ncclCommDestroy(c->comm);
    }
    if (c->stream != NULL) {
        (void)c->cu->cudaSetDevice(c->device);
        (void)c->cu->cudaStreamSynchronize(c->stream);
        (void)c->cu->cudaStreamDestroy(c->stream);
    }
    if (c->before != NULL)
        (void)c->cu->cudaEventDestroy(c->before);
    if (c->after != NULL)
        (void)c->cu->cudaEventDestroy(c->after);
    free(c);
}

int ss_comm_nranks(const ss_comm *c)
{
    return c->nranks;
}

int ss_comm_rank(const ss_comm *c)
{
    return c->rank;
}

int ss_comm_device(const ss_comm *c)
{
    return c->device;
}

enum { ALL_GATHER, BROADCAST, SCATTER, GATHER };

/* Order, queue one collective, order back (and wait). */
static int run(ss_comm *c, int op, const void *send, void *recv, size_t n,
               int root, void *caller, int wait, ss_errinfo *err)
{
    const ss_cuda *cu = c->cu;
    const ss_nccl *nc = c->nc;
    ss_cudaStream_t cs = (ss_cudaStream_t)caller;
    int rc = 0, grouped = 0;

    int root_only_recv = op == GATHER && c->rank != root;  /* recv unused */
    int root_only_send = op == SCATTER && c->rank != root; /* send unused */
    if ((op != ALL_GATHER && (root < 0 || root >= c->nranks)) ||
        (n > 0 && ((op != BROADCAST && recv == NULL && !root_only_recv) ||
                   (send == NULL && !root_only_send))))
        return ss_errinfo_set(err, SS_EINVAL, "comm", NULL, -1,
                              "root %d of %d ranks, or a NULL buffer", root,
                              c->nranks);
    CU(cu, cu->cudaSetDevice(c->device), "cudaSetDevice");
    CU(cu, cu->cudaEventRecord(c->before, cs), "cudaEventRecord");
    CU(cu, cu->cudaStreamWaitEvent(c->stream, c->before, 0),
       "cudaStreamWaitEvent");
    switch (op) {
    case ALL_GATHER:
        NC(nc,
           nc->ncclAllGather(send, recv, n, SS_NCCL_UINT8, c->comm, c->stream),
           "ncclAllGather");
        break;
    case BROADCAST:
        NC(nc,
           nc->ncclBroadcast(send, recv, n, SS_NCCL_UINT8, root, c->comm,
                             c->stream),
           "ncclBroadcast");
        break;
    case SCATTER:
        NC(nc, nc->ncclGroupStart(), "ncclGroupStart");
        grouped = 1;
        if (c->rank == root) {
            for (int r = 0; r < c->nranks; r++) {
                const char *blk = (const char *)send + (size_t)r * n;
                if (r == root)
                    CU(cu,
                       cu->cudaMemcpyAsync(recv, blk, n,
                                           3 /* device to device */, c->stream),
                       "cudaMemcpyAsync");
                else
                    NC(nc,
                       nc->ncclSend(blk, n, SS_NCCL_UINT8, r, c->comm,
                                    c->stream),
                       "ncclSend");
            }
        } else {
            NC(nc,
               nc->ncclRecv(recv, n, SS_NCCL_UINT8, root, c->comm, c->stream),
               "ncclRecv");
        }
        grouped = 0;
        NC(nc, nc->ncclGroupEnd(), "ncclGroupEnd");
        break;
    case GATHER:
        NC(nc, nc->ncclGroupStart(), "ncclGroupStart");
        grouped = 1;
        if (c->rank == root) {
            for (int r = 0; r < c->nranks; r++) {
                char *blk = (char *)recv + (size_t)r * n;
                if (r == root)
                    CU(cu,
                       cu->cudaMemcpyAsync(blk, send, n,
                                           3 /* device to device */, c->stream),
                       "cudaMemcpyAsync");
                else
                    NC(nc,
                       nc->ncclRecv(blk, n, SS_NCCL_UINT8, r, c->comm,
                                    c->stream),
                       "ncclRecv");
            }
        } else {
            NC(nc,
               nc->ncclSend(send, n, SS_NCCL_UINT8, root, c->comm, c->stream),
               "ncclSend");
        }
        grouped = 0;
        NC(nc, nc->ncclGroupEnd(), "ncclGroupEnd");
        break;
    }
    CU(cu, cu->cudaEventRecord(c->after, c->stream), "cudaEventRecord");
    CU(cu, cu->cudaStreamWaitEvent(cs, c->after, 0), "cudaStreamWaitEvent");
    if (wait) {
        ss_ncclResult_t async = SS_NCCL_SUCCESS;
        CU(cu, cu->cudaEventSynchronize(c->after), "cudaEventSynchronize");
        NC(nc, nc->ncclCommGetAsyncError(c->comm, &async),
           "ncclCommGetAsyncError");
        NC(nc, async, "NCCL (asynchronous)");
    }
out:
    if (grouped)
        (void)nc->ncclGroupEnd();
    if (rc < 0)
        c->broken = 1;
    return rc;
}

int ss_comm_all_gather(ss_comm *c, const void *send, void *recv, size_t n,
                       void *stream, int wait, ss_errinfo *err)
{
    return run(c, ALL_GATHER, send, recv, n, 0, stream, wait, err);
}

int ss_comm_broadcast(ss_comm *c, void *buf, size_t n, int root, void *stream,
                      int wait, ss_errinfo *err)
{
    return run(c, BROADCAST, buf, buf, n, root, stream, wait, err);
}

int ss_comm_scatter(ss_comm *c, const void *send, void *recv, size_t n,
                    int root, void *stream, int wait, ss_errinfo *err)
{
    return run(c, SCATTER, send, recv, n, root, stream, wait, err);
}

int ss_comm_gather(ss_comm *c, const void *send, void *recv, size_t n, int root,
                   void *stream, int wait, ss_errinfo *err)
{
    return run(c, GATHER, send, recv, n, root, stream, wait, err);
}
