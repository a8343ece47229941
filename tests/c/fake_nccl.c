/* fake_nccl.c - a stand-in libnccl for the loader tests, exporting the
 * symbols ss_nccl loads:
 *   -DFAKE_NCCL_VERSION=22105   what ncclGetVersion reports (raw code)
 *   -DFAKE_OMIT_SEND            leave ncclSend out
 * A one-rank "communicator" whose collectives copy send to receive buffers
 * on the host; nothing here touches a GPU. */
#include <string.h>

#ifndef FAKE_NCCL_VERSION
#define FAKE_NCCL_VERSION 22105
#endif

#define API __attribute__((visibility("default")))

typedef struct {
    char internal[128];
} fake_id;
static int fake_comm;

API int ncclGetVersion(int *v)
{
    *v = FAKE_NCCL_VERSION;
    return 0;
}
API int ncclGetUniqueId(fake_id *id)
{
    memset(id, 0x5a, sizeof *id);
    return 0;
}

API int ncclCommInitRank(void **comm, int nranks, fake_id id, int rank)
{
    (void)id;
    if (nranks != 1 || rank != 0)
        return 4; /* ncclInvalidArgument */
    *comm = &fake_comm;
    return 0;
}

API int ncclCommDestroy(void *c)
{
    (void)c;
    return 0;
}
API int ncclCommAbort(void *c)
{
    (void)c;
    return 0;
}
API int ncclCommGetAsyncError(void *c, int *e)
{
    (void)c;
    *e = 0;
    return 0;
}

API const char *ncclGetErrorString(int r)
{
    return r == 0 ? "no error" : "invalid argument";
}

static size_t type_size(int t)
{
    static const size_t sz[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
    return t >= 0 && t < 10 ? sz[t] : 1;
}

API int ncclAllGather(const void *s, void *r, size_t n, int t, void *c,
                      void *st)
{
    (void)c;
    (void)st;
    memmove(r, s, n * type_size(t));
    return 0;
}

API int ncclBroadcast(const void *s, void *r, size_t n, int t, int root,
                      void *c, void *st)
{
    (void)root;
    (void)c;
    (void)st;
    memmove(r, s, n * type_size(t));
    return 0;
}

API int ncclReduceScatter(const void *s, void *r, size_t n, int t, int op,
                          void *c, void *st)
{
    (void)op;
    (void)c;
    (void)st;
    memmove(r, s, n * type_size(t));
    return 0;
}

API int ncclGroupStart(void)
{
    return 0;
}
API int ncclGroupEnd(void)
{
    return 0;
}
#ifndef FAKE_OMIT_SEND
API int ncclSend(const void *s, size_t n, int t, int peer, void *c, void *st)
{
    (void)s;
    (void)n;
    (void)t;
    (void)peer;
    (void)c;
    (void)st;
    return 0;
}
#endif
API int ncclRecv(void *r, size_t n, int t, int peer, void *c, void *st)
{
    (void)r;
    (void)n;
    (void)t;
    (void)peer;
    (void)c;
    (void)st;
    return 0;
}
