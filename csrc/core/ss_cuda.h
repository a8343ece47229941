/* ss_cuda.h - the CUDA runtime (libcudart), loaded at run time.
 *
 * Nothing here needs CUDA to build or to run: the few CUDA types and
 * constants the core uses are declared below (opaque handles as pointers to
 * CUDA's own incomplete struct tags, enums as int, cudaPointerAttributes
 * with CUDA 13's size). When setup.py finds the toolkit's headers it defines
 * SS_HAVE_CUDA_HEADERS; then the ss_ types are the real ones and ss_cuda.c
 * checks at compile time that every prototype in SS_CUDA_SYMBOLS matches the
 * header's and that each fallback type has the real one's size and layout,
 * so the header-less build calls the library with the same ABI. Nothing is
 * linked against libcudart either way.
 *
 * ss_cuda_load() returns the process-wide table of function pointers (one
 * per library file, loaded once, never unloaded; see ss_dl.h). It refuses a
 * runtime older than SS_CUDA_MIN_RUNTIME and a library lacking any symbol,
 * with a reason. Loading does not initialise the driver; ss_cuda_probe()
 * does (cudaGetDeviceCount), as torch.cuda.is_available() does: a process
 * that has probed should not fork children that use CUDA.
 *
 * Thread safety: all functions may be called from any thread; the table is
 * immutable once returned. The core never reads the environment: override
 * paths are chosen by the caller and passed in as candidates.
 */
#ifndef SS_CUDA_H
#define SS_CUDA_H

#include "ss_dl.h"

#include <stddef.h>

/* CUDA 11.0 (11000): the oldest runtime accepted. Everything in the table
 * exists since CUDA 4-10, but cudaPointerAttributes lost its memoryType
 * member in 10.0 and the CUDA 11+ layout is the one declared here; 11.0 is
 * also the oldest runtime a supported torch build ships. */
#define SS_CUDA_MIN_RUNTIME 11000

/* Fallback declarations, always visible so ss_cuda.c can compare them with
 * the real ones. Handles are pointers to the same struct tags CUDA uses. */
typedef int ss__fb_cudaError_t;
typedef int ss__fb_cudaMemcpyKind;
typedef struct CUstream_st *ss__fb_cudaStream_t;
typedef struct CUevent_st *ss__fb_cudaEvent_t;
typedef struct ss__fb_cudaPointerAttributes {
    int type; /* enum cudaMemoryType */
    int device;
    void *devicePointer;
    void *hostPointer;
    long reserved[8]; /* CUDA 13; older runtimes write only the above */
} ss__fb_cudaPointerAttributes;

#ifdef SS_HAVE_CUDA_HEADERS
#include <cuda_runtime_api.h>
typedef cudaError_t ss_cudaError_t;
typedef enum cudaMemcpyKind ss_cudaMemcpyKind;
typedef cudaStream_t ss_cudaStream_t;
typedef cudaEvent_t ss_cudaEvent_t;
typedef struct cudaPointerAttributes ss_cudaPointerAttributes;
#else
typedef ss__fb_cudaError_t ss_cudaError_t;
typedef ss__fb_cudaMemcpyKind ss_cudaMemcpyKind;
typedef ss__fb_cudaStream_t ss_cudaStream_t;
typedef ss__fb_cudaEvent_t ss_cudaEvent_t;
typedef ss__fb_cudaPointerAttributes ss_cudaPointerAttributes;
#endif

/* Constants the core uses (checked against the headers when present). */
#define SS_CUDA_SUCCESS 0
#define SS_CUDA_ERROR_INSUFFICIENT_DRIVER 35
#define SS_CUDA_ERROR_NO_DEVICE 100
#define SS_CUDA_HOST_ALLOC_DEFAULT 0x00u
#define SS_CUDA_HOST_ALLOC_PORTABLE 0x01u
#define SS_CUDA_HOST_REGISTER_DEFAULT 0x00u
#define SS_CUDA_STREAM_NON_BLOCKING 0x01u
#define SS_CUDA_EVENT_DISABLE_TIMING 0x02u
#define SS_CUDA_MEMCPY_HOST_TO_DEVICE 1
#define SS_CUDA_MEMCPY_DEVICE_TO_HOST 2
#define SS_CUDA_MEMORY_TYPE_UNREGISTERED 0
#define SS_CUDA_MEMORY_TYPE_HOST 1
#define SS_CUDA_MEMORY_TYPE_DEVICE 2
#define SS_CUDA_MEMORY_TYPE_MANAGED 3

/* X(return type, name, parameter list): every symbol the table holds. */
#define SS_CUDA_SYMBOLS(X)                                                     \
    X(ss_cudaError_t, cudaRuntimeGetVersion, (int *runtimeVersion))            \
    X(ss_cudaError_t, cudaDriverGetVersion, (int *driverVersion))              \
    X(ss_cudaError_t, cudaGetDeviceCount, (int *count))                        \
    X(ss_cudaError_t, cudaGetDevice, (int *device))                            \
    X(ss_cudaError_t, cudaSetDevice, (int device))                             \
    X(const char *, cudaGetErrorString, (ss_cudaError_t error))                \
    X(ss_cudaError_t, cudaHostAlloc,                                           \
      (void **pHost, size_t size, unsigned int flags))                         \
    X(ss_cudaError_t, cudaFreeHost, (void *ptr))                               \
    X(ss_cudaError_t, cudaHostRegister,                                        \
      (void *ptr, size_t size, unsigned int flags))                            \
    X(ss_cudaError_t, cudaHostUnregister, (void *ptr))                         \
    X(ss_cudaError_t, cudaStreamCreateWithFlags,                               \
      (ss_cudaStream_t * pStream, unsigned int flags))                         \
    X(ss_cudaError_t, cudaStreamDestroy, (ss_cudaStream_t stream))             \
    X(ss_cudaError_t, cudaStreamSynchronize, (ss_cudaStream_t stream))         \
    X(ss_cudaError_t, cudaStreamWaitEvent,                                     \
      (ss_cudaStream_t stream, ss_cudaEvent_t event, unsigned int flags))      \
    X(ss_cudaError_t, cudaEventCreateWithFlags,                                \
      (ss_cudaEvent_t * event, unsigned int flags))                            \
    X(ss_cudaError_t, cudaEventRecord,                                         \
      (ss_cudaEvent_t event, ss_cudaStream_t stream))                          \
    X(ss_cudaError_t, cudaEventSynchronize, (ss_cudaEvent_t event))            \
    X(ss_cudaError_t, cudaEventQuery, (ss_cudaEvent_t event))                  \
    X(ss_cudaError_t, cudaEventDestroy, (ss_cudaEvent_t event))                \
    X(ss_cudaError_t, cudaMemcpyAsync,                                         \
      (void *dst, const void *src, size_t count, ss_cudaMemcpyKind kind,       \
       ss_cudaStream_t stream))                                                \
    X(ss_cudaError_t, cudaPointerGetAttributes,                                \
      (ss_cudaPointerAttributes * attributes, const void *ptr))

#define SS__CUDA_FN_TYPEDEF(ret, name, params)                                 \
    typedef ret(*ss_##name##_fn) params;
SS_CUDA_SYMBOLS(SS__CUDA_FN_TYPEDEF)
#undef SS__CUDA_FN_TYPEDEF

/* The loaded runtime: call through the members, e.g.
 * cu->cudaStreamSynchronize(s). */
typedef struct ss_cuda {
    ss_dl_lib lib;       /* path of the file loaded; first member */
    int runtime_version; /* e.g. 12040 for 12.4 */
    int driver_version;  /* 0 when no driver is installed */
#define SS__CUDA_MEMBER(ret, name, params) ss_##name##_fn name;
    SS_CUDA_SYMBOLS(SS__CUDA_MEMBER)
#undef SS__CUDA_MEMBER
} ss_cuda;

/* Load (or find already loaded) the first usable library among
 * cands[0..n), or among libcudart.so.13, .so.12, .so.11.0, .so when cands
 * is NULL. 0 with *out set; SS_ENOTAVAIL / SS_EINVAL with the reason in
 * reason[reason_len] (reason may be NULL); SS_ENOMEM. */
int ss_cuda_load(const char *const *cands, size_t n, const ss_cuda **out,
                 char *reason, size_t reason_len);

typedef struct ss_cuda_status {
    int loaded;          /* library found, all symbols, version accepted */
    int available;       /* loaded and at least one device */
    int runtime_version; /* 0 when not loaded */
    int driver_version;  /* 0 when not loaded or no driver */
    int device_count;    /* 0 unless cudaGetDeviceCount succeeded */
    int device_error;    /* cudaGetDeviceCount's error code, 0 on success */
    char path[SS_DL_PATH_MAX];     /* file loaded, or "" */
    char reason[SS_DL_REASON_MAX]; /* why not available, or "" */
} ss_cuda_status;

/* Load as ss_cuda_load and count devices. Fills *st in every case; returns
 * 0 when available, SS_ENOTAVAIL (or SS_EINVAL / SS_ENOMEM) otherwise. */
int ss_cuda_probe(const char *const *cands, size_t n, ss_cuda_status *st);

#endif /* SS_CUDA_H */
