/* ss_nccl.h - NCCL (libnccl), loaded at run time.
 *
 * As ss_cuda.h: the few NCCL types the core uses are declared here (the
 * communicator as a pointer to NCCL's own struct tag, ncclUniqueId as its
 * 128 bytes, enums as int); with SS_HAVE_NCCL_HEADERS (setup.py found
 * nccl.h) the ss_ types are NCCL's own and ss_nccl.c checks every prototype
 * and size at compile time. Nothing links against libnccl.
 *
 * ss_nccl_load() returns the process-wide table (one per library file, loaded
 * once, never unloaded; see ss_dl.h). It refuses NCCL older than
 * SS_NCCL_MIN_VERSION and a library lacking any symbol, with a reason.
 * Loading NCCL touches no device; whether a GPU is there is ss_cuda's
 * question, and callers need both.
 *
 * Thread safety: all functions may be called from any thread; the table is
 * immutable once returned. NCCL's own rules apply to the calls made through
 * it (one communicator per thread at a time, group calls per thread).
 */
#ifndef SS_NCCL_H
#define SS_NCCL_H

#include "ss_cuda.h"
#include "ss_dl.h"

#include <stddef.h>

/* NCCL 2.12.0: ncclSend/ncclRecv (2.7), bfloat16 (2.10), and
 * ncclCommGetAsyncError / ncclCommAbort with the error semantics the
 * communicator teardown relies on; 2.12 is the oldest the torch releases we
 * target were built against. Codes: 10000 * major + 100 * minor + patch
 * (NCCL >= 2.9; older releases used 1000 * major + 100 * minor + patch). */
#define SS_NCCL_MIN_VERSION 21200

#define SS_NCCL_UNIQUE_ID_BYTES 128

typedef int ss__fb_ncclResult_t;
typedef int ss__fb_ncclDataType_t;
typedef int ss__fb_ncclRedOp_t;
typedef struct ncclComm *ss__fb_ncclComm_t;
typedef struct {
    char internal[SS_NCCL_UNIQUE_ID_BYTES];
} ss__fb_ncclUniqueId;

#ifdef SS_HAVE_NCCL_HEADERS
#include <nccl.h>
typedef ncclResult_t ss_ncclResult_t;
typedef ncclDataType_t ss_ncclDataType_t;
typedef ncclRedOp_t ss_ncclRedOp_t;
typedef ncclComm_t ss_ncclComm_t;
typedef ncclUniqueId ss_ncclUniqueId;
#else
typedef ss__fb_ncclResult_t ss_ncclResult_t;
typedef ss__fb_ncclDataType_t ss_ncclDataType_t;
typedef ss__fb_ncclRedOp_t ss_ncclRedOp_t;
typedef ss__fb_ncclComm_t ss_ncclComm_t;
typedef ss__fb_ncclUniqueId ss_ncclUniqueId;
#endif

#define SS_NCCL_SUCCESS 0
#define SS_NCCL_IN_PROGRESS 7
#define SS_NCCL_INT8 0
#define SS_NCCL_UINT8 1
#define SS_NCCL_INT32 2
#define SS_NCCL_UINT32 3
#define SS_NCCL_INT64 4
#define SS_NCCL_UINT64 5
#define SS_NCCL_FLOAT16 6
#define SS_NCCL_FLOAT32 7
#define SS_NCCL_FLOAT64 8
#define SS_NCCL_BFLOAT16 9
#define SS_NCCL_SUM 0

/* X(return type, name, parameter list). ncclReduceScatter is included:
 * every NCCL since 2.0 has it. */
#define SS_NCCL_SYMBOLS(X)                                                     \
    X(ss_ncclResult_t, ncclGetVersion, (int *version))                         \
    X(ss_ncclResult_t, ncclGetUniqueId, (ss_ncclUniqueId * uniqueId))          \
    X(ss_ncclResult_t, ncclCommInitRank,                                       \
      (ss_ncclComm_t * comm, int nranks, ss_ncclUniqueId commId, int rank))    \
    X(ss_ncclResult_t, ncclCommDestroy, (ss_ncclComm_t comm))                  \
    X(ss_ncclResult_t, ncclCommAbort, (ss_ncclComm_t comm))                    \
    X(ss_ncclResult_t, ncclCommGetAsyncError,                                  \
      (ss_ncclComm_t comm, ss_ncclResult_t * asyncError))                      \
    X(const char *, ncclGetErrorString, (ss_ncclResult_t result))              \
    X(ss_ncclResult_t, ncclAllGather,                                          \
      (const void *sendbuff, void *recvbuff, size_t sendcount,                 \
       ss_ncclDataType_t datatype, ss_ncclComm_t comm,                         \
       ss_cudaStream_t stream))                                                \
    X(ss_ncclResult_t, ncclBroadcast,                                          \
      (const void *sendbuff, void *recvbuff, size_t count,                     \
       ss_ncclDataType_t datatype, int root, ss_ncclComm_t comm,               \
       ss_cudaStream_t stream))                                                \
    X(ss_ncclResult_t, ncclReduceScatter,                                      \
      (const void *sendbuff, void *recvbuff, size_t recvcount,                 \
       ss_ncclDataType_t datatype, ss_ncclRedOp_t op, ss_ncclComm_t comm,      \
       ss_cudaStream_t stream))                                                \
    X(ss_ncclResult_t, ncclGroupStart, (void))                                 \
    X(ss_ncclResult_t, ncclGroupEnd, (void))                                   \
    X(ss_ncclResult_t, ncclSend,                                               \
      (const void *sendbuff, size_t count, ss_ncclDataType_t datatype,         \
       int peer, ss_ncclComm_t comm, ss_cudaStream_t stream))                  \
    X(ss_ncclResult_t, ncclRecv,                                               \
      (void *recvbuff, size_t count, ss_ncclDataType_t datatype, int peer,     \
       ss_ncclComm_t comm, ss_cudaStream_t stream))

#define SS__NCCL_FN_TYPEDEF(ret, name, params)                                 \
    typedef ret(*ss_##name##_fn) params;
SS_NCCL_SYMBOLS(SS__NCCL_FN_TYPEDEF)
#undef SS__NCCL_FN_TYPEDEF

/* The loaded library: call through the members, e.g. nc->ncclGroupStart(). */
typedef struct ss_nccl {
    ss_dl_lib lib; /* path of the file loaded; first member */
    int version;   /* normalised to 10000 * major + 100 * minor + patch */
#define SS__NCCL_MEMBER(ret, name, params) ss_##name##_fn name;
    SS_NCCL_SYMBOLS(SS__NCCL_MEMBER)
#undef SS__NCCL_MEMBER
} ss_nccl;

/* Normalise an ncclGetVersion code (either encoding) to
 * 10000 * major + 100 * minor + patch. */
int ss_nccl_version_code(int raw);

/* Load (or find already loaded) the first usable library among
 * cands[0..n), or among libnccl.so.2, libnccl.so when cands is NULL.
 * 0 with *out set; SS_ENOTAVAIL / SS_EINVAL with the reason in
 * reason[reason_len] (reason may be NULL); SS_ENOMEM. */
int ss_nccl_load(const char *const *cands, size_t n, const ss_nccl **out,
                 char *reason, size_t reason_len);

typedef struct ss_nccl_status {
    int loaded;  /* library found, all symbols, version accepted */
    int version; /* normalised code, 0 when not loaded */
    char path[SS_DL_PATH_MAX];
    char reason[SS_DL_REASON_MAX];
} ss_nccl_status;

/* Load as ss_nccl_load and fill *st in every case; 0 when loaded,
 * SS_ENOTAVAIL (or SS_EINVAL / SS_ENOMEM) otherwise. */
int ss_nccl_probe(const char *const *cands, size_t n, ss_nccl_status *st);

#endif /* SS_NCCL_H */
