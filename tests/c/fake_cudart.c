/* fake_cudart.c - a stand-in libcudart for the loader tests: it exports the
 * symbols ss_cuda loads, with behaviour chosen when it is compiled:
 *   -DFAKE_RUNTIME_VERSION=12040   what cudaRuntimeGetVersion reports
 *   -DFAKE_DRIVER_VERSION=12040    what cudaDriverGetVersion reports
 *   -DFAKE_DEVICE_COUNT=2          devices cudaGetDeviceCount finds
 *   -DFAKE_DEVICE_ERROR=100        cudaGetDeviceCount fails with this code
 *   -DFAKE_OMIT_EVENT_QUERY        leave cudaEventQuery out
 * Stream/event/copy calls do the host-side minimum (pinned memory is plain
 * malloc); nothing here touches a GPU. Built with plain cc -shared -fPIC. */
#include <stdlib.h>
#include <string.h>

#ifndef FAKE_RUNTIME_VERSION
#define FAKE_RUNTIME_VERSION 12040
#endif
#ifndef FAKE_DRIVER_VERSION
#define FAKE_DRIVER_VERSION 12040
#endif
#ifndef FAKE_DEVICE_COUNT
#define FAKE_DEVICE_COUNT 2
#endif
#ifndef FAKE_DEVICE_ERROR
#define FAKE_DEVICE_ERROR 0
#endif

#define API __attribute__((visibility("default")))

static int current_device;
static long copies, fail_at, kinds[3], waits; /* see fake_cuda_* below */
static int fail_code;

API int cudaRuntimeGetVersion(int *v)
{
    *v = FAKE_RUNTIME_VERSION;
    return 0;
}
API int cudaDriverGetVersion(int *v)
{
    *v = FAKE_DRIVER_VERSION;
    return 0;
}

API int cudaGetDeviceCount(int *n)
{
    *n = 0;
    if (FAKE_DEVICE_ERROR != 0)
        return FAKE_DEVICE_ERROR;
    *n = FAKE_DEVICE_COUNT;
    return 0;
}

API int cudaGetDevice(int *d)
{
    *d = current_device;
    return 0;
}

API int cudaSetDevice(int d)
{
    if (d < 0 || d >= FAKE_DEVICE_COUNT)
        return 101; /* cudaErrorInvalidDevice */
    current_device = d;
    return 0;
}

API const char *cudaGetErrorString(int e)
{
    switch (e) {
    case 0:
        return "no error";
    case 35:
        return "CUDA driver version is insufficient for CUDA runtime version";
    case 100:
        return "no CUDA-capable device is detected";
    case 101:
        return "invalid device ordinal";
    case 700:
        return "an illegal memory access was encountered";
    default:
        return "unrecognized error code";
    }
}

API int cudaHostAlloc(void **p, size_t n, unsigned flags)
{
    (void)flags;
    *p = malloc(n ? n : 1);
    return *p ? 0 : 2; /* cudaErrorMemoryAllocation */
}
API int cudaFreeHost(void *p)
{
    free(p);
    return 0;
}
API int cudaHostRegister(void *p, size_t n, unsigned f)
{
    (void)p;
    (void)n;
    (void)f;
    return 0;
}
API int cudaHostUnregister(void *p)
{
    (void)p;
    return 0;
}

static int fake_handle;
API int cudaStreamCreateWithFlags(void **s, unsigned f)
{
    (void)f;
    *s = &fake_handle;
    return 0;
}
API int cudaStreamDestroy(void *s)
{
    (void)s;
    return 0;
}
API int cudaStreamSynchronize(void *s)
{
    (void)s;
    return 0;
}
API int cudaStreamWaitEvent(void *s, void *e, unsigned f)
{
    (void)s;
    (void)e;
    (void)f;
    waits++;
    return 0;
}
API int cudaEventCreateWithFlags(void **e, unsigned f)
{
    (void)f;
    *e = &fake_handle;
    return 0;
}
API int cudaEventRecord(void *e, void *s)
{
    (void)e;
    (void)s;
    return 0;
}
API int cudaEventSynchronize(void *e)
{
    (void)e;
    return 0;
}
#ifndef FAKE_OMIT_EVENT_QUERY
API int cudaEventQuery(void *e)
{
    (void)e;
    return 0;
}
#endif
API int cudaEventDestroy(void *e)
{
    (void)e;
    return 0;
}

/* Test knobs and counters for the staging backend's tests (test_devcuda),
 * found with dlsym on the loaded library. */
API void fake_cuda_fail_copy_at(long k, int code)
{
    fail_at = k ? copies + k : 0;
    fail_code = code;
}
API long fake_cuda_copies(int kind)
{
    return kind < 0 ? copies : kinds[kind % 3];
}
API long fake_cuda_waits(void)
{
    return waits;
}

API int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *s)
{
    (void)s;
    if (fail_at != 0 && copies + 1 == fail_at) {
        fail_at = 0;
        return fail_code;
    }
    copies++;
    if (kind >= 0 && kind < 3)
        kinds[kind]++;
    memmove(dst, src, n);
    return 0;
}

API int cudaPointerGetAttributes(void *attr, const void *ptr)
{
    (void)ptr;
    memset(attr, 0, 24); /* CUDA 11/12's size: type 0 = unregistered */
    return 0;
}
