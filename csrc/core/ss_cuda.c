/* ss_cuda.c - the libcudart table, its version check and the device probe.
 * Thread safety: as ss_cuda.h (loading is serialised inside ss_dl). */
#include "ss_cuda.h"

#include "ss_error.h"

#include <stdio.h>
#include <string.h>

#ifdef SS_HAVE_CUDA_HEADERS
/* Compile-time proof that the declarations used without headers match the
 * toolkit's. _Generic does not evaluate its operand, so &cudaX creates no
 * reference to the symbol and nothing is linked. */
#if defined(CUDA_API_PER_THREAD_DEFAULT_STREAM)
#error                                                                         \
    "per-thread default stream maps cudaMemcpyAsync to a _ptsz symbol; build without it"
#endif
#define SS__CHECK_PROTO(ret, name, params)                                     \
    _Static_assert(_Generic(&name, ss_##name##_fn: 1, default: 0),             \
                   #name " does not match the CUDA header's prototype");
SS_CUDA_SYMBOLS(SS__CHECK_PROTO)
#undef SS__CHECK_PROTO

#define SS__SAME_ABI(a, b)                                                     \
    _Static_assert(sizeof(a) == sizeof(b) && _Alignof(a) == _Alignof(b),       \
                   #a " and " #b " differ in size or alignment")
SS__SAME_ABI(ss__fb_cudaError_t, cudaError_t);
SS__SAME_ABI(ss__fb_cudaMemcpyKind, enum cudaMemcpyKind);
SS__SAME_ABI(ss__fb_cudaStream_t, cudaStream_t);
SS__SAME_ABI(ss__fb_cudaEvent_t, cudaEvent_t);
#undef SS__SAME_ABI
_Static_assert(_Generic((ss__fb_cudaStream_t)0, cudaStream_t: 1, default: 0),
               "cudaStream_t is not a pointer to struct CUstream_st");
_Static_assert(_Generic((ss__fb_cudaEvent_t)0, cudaEvent_t: 1, default: 0),
               "cudaEvent_t is not a pointer to struct CUevent_st");
/* The runtime writes at most sizeof(struct cudaPointerAttributes) bytes, and
 * the members the core reads sit where the runtime puts them. */
_Static_assert(sizeof(ss__fb_cudaPointerAttributes) >=
                   sizeof(struct cudaPointerAttributes),
               "fallback cudaPointerAttributes is smaller than CUDA's");
#define SS__SAME_OFFSET(m)                                                     \
    _Static_assert(offsetof(ss__fb_cudaPointerAttributes, m) ==                \
                       offsetof(struct cudaPointerAttributes, m),              \
                   "cudaPointerAttributes." #m " moved")
SS__SAME_OFFSET(type);
SS__SAME_OFFSET(device);
SS__SAME_OFFSET(devicePointer);
SS__SAME_OFFSET(hostPointer);
#undef SS__SAME_OFFSET
_Static_assert(sizeof(enum cudaMemoryType) == sizeof(int),
               "enum cudaMemoryType is not int-sized");
_Static_assert(SS_CUDA_SUCCESS == cudaSuccess &&
                   SS_CUDA_ERROR_INSUFFICIENT_DRIVER ==
                       cudaErrorInsufficientDriver &&
                   SS_CUDA_ERROR_NO_DEVICE == cudaErrorNoDevice,
               "cudaError_t values differ");
_Static_assert(SS_CUDA_HOST_ALLOC_DEFAULT == cudaHostAllocDefault &&
                   SS_CUDA_HOST_ALLOC_PORTABLE == cudaHostAllocPortable &&
                   SS_CUDA_HOST_REGISTER_DEFAULT == cudaHostRegisterDefault &&
                   SS_CUDA_STREAM_NON_BLOCKING == cudaStreamNonBlocking &&
                   SS_CUDA_EVENT_DISABLE_TIMING == cudaEventDisableTiming,
               "CUDA flag values differ");
_Static_assert(SS_CUDA_MEMCPY_HOST_TO_DEVICE == cudaMemcpyHostToDevice &&
                   SS_CUDA_MEMCPY_DEVICE_TO_HOST == cudaMemcpyDeviceToHost,
               "cudaMemcpyKind values differ");
_Static_assert(SS_CUDA_MEMORY_TYPE_UNREGISTERED == cudaMemoryTypeUnregistered &&
                   SS_CUDA_MEMORY_TYPE_HOST == cudaMemoryTypeHost &&
                   SS_CUDA_MEMORY_TYPE_DEVICE == cudaMemoryTypeDevice &&
                   SS_CUDA_MEMORY_TYPE_MANAGED == cudaMemoryTypeManaged,
               "cudaMemoryType values differ");
#endif /* SS_HAVE_CUDA_HEADERS */

static const char *const default_names[] = {
    "libcudart.so.13",
    "libcudart.so.12",
    "libcudart.so.11.0",
    "libcudart.so",
};

static const ss_dl_sym symbols[] = {
#define SS__SYM(ret, name, params) {#name, offsetof(ss_cuda, name)},
    SS_CUDA_SYMBOLS(SS__SYM)
#undef SS__SYM
};

/* CUDA encodes versions as 1000 * major + 10 * minor. */
static int check_versions(void *table, char *why, size_t why_len)
{
    ss_cuda *cu = table;
    int v = 0, rc;

    rc = cu->cudaRuntimeGetVersion(&v);
    if (rc != SS_CUDA_SUCCESS) {
        snprintf(why, why_len, "cudaRuntimeGetVersion returned %d", rc);
        return SS_ENOTAVAIL;
    }
    if (v < SS_CUDA_MIN_RUNTIME) {
        snprintf(why, why_len,
                 "CUDA runtime %d.%d is older than the minimum %d.%d", v / 1000,
                 (v % 1000) / 10, SS_CUDA_MIN_RUNTIME / 1000,
                 (SS_CUDA_MIN_RUNTIME % 1000) / 10);
        return SS_ENOTAVAIL;
    }
    cu->runtime_version = v;
    /* 0 (and success) when no driver is installed: not a reason to refuse
     * the library; the device probe reports it. */
    v = 0;
    if (cu->cudaDriverGetVersion(&v) != SS_CUDA_SUCCESS || v < 0)
        v = 0;
    cu->driver_version = v;
    return 0;
}

static const ss_dl_spec spec = {
    .what = "libcudart",
    .defaults = default_names,
    .ndefaults = sizeof default_names / sizeof default_names[0],
    .syms = symbols,
    .nsyms = sizeof symbols / sizeof symbols[0],
    .table_size = sizeof(ss_cuda),
    .check = check_versions,
};

int ss_cuda_load(const char *const *cands, size_t n, const ss_cuda **out,
                 char *reason, size_t reason_len)
{
    const void *t = NULL;
    int rc = ss_dl_load(&spec, cands, n, &t, reason, reason_len);

    *out = rc == 0 ? t : NULL;
    return rc;
}

int ss_cuda_probe(const char *const *cands, size_t n, ss_cuda_status *st)
{
    const ss_cuda *cu = NULL;
    int rc, count = 0, err;

    memset(st, 0, sizeof *st);
    rc = ss_cuda_load(cands, n, &cu, st->reason, sizeof st->reason);
    if (rc < 0)
        return rc;
    st->loaded = 1;
    st->runtime_version = cu->runtime_version;
    st->driver_version = cu->driver_version;
    snprintf(st->path, sizeof st->path, "%s", cu->lib.path);
    err = cu->cudaGetDeviceCount(&count);
    if (err != SS_CUDA_SUCCESS) {
        const char *s = cu->cudaGetErrorString(err);
        st->device_error = err;
        snprintf(st->reason, sizeof st->reason,
                 "no CUDA device: cudaGetDeviceCount returned %d (%s)", err,
                 s != NULL ? s : "unknown error");
        return SS_ENOTAVAIL;
    }
    if (count <= 0) {
        snprintf(st->reason, sizeof st->reason,
                 "no CUDA device: cudaGetDeviceCount found %d devices", count);
        return SS_ENOTAVAIL;
    }
    st->device_count = count;
    st->available = 1;
    return 0;
}
