/* ss_devcuda.c - see ss_devcuda.h. */
#include "ss_devcuda.h"

#include "ss_error.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct ss_devcuda {
    ss_dev dev;
    const ss_cuda *cu;
    int device;
    ss_cudaEvent_t order; /* recorded on the caller's stream */
    pthread_mutex_t mu;   /* order, last */
    char last[256];
};

/* Remember a failed call; SS_EDEVICE. */
static int fail(ss_devcuda *d, const char *call, ss_cudaError_t e)
{
    const char *msg = d->cu->cudaGetErrorString(e);
    pthread_mutex_lock(&d->mu);
    snprintf(d->last, sizeof d->last, "%s: %s (CUDA error %d)", call,
             msg != NULL ? msg : "unknown error", (int)e);
    pthread_mutex_unlock(&d->mu);
    return SS_EDEVICE;
}

#define CALL(d, expr, name)                                                    \
    do {                                                                       \
        ss_cudaError_t e_ = (expr);                                            \
        if (e_ != SS_CUDA_SUCCESS)                                             \
            return fail((d), (name), e_);                                      \
    } while (0)

/* The device current on this thread: worker threads start on device 0. */
static int current(ss_devcuda *d)
{
    int cur = -1;
    CALL(d, d->cu->cudaGetDevice(&cur), "cudaGetDevice");
    if (cur != d->device)
        CALL(d, d->cu->cudaSetDevice(d->device), "cudaSetDevice");
    return 0;
}

static int host_alloc(const ss_dev *dev, size_t n, void **out)
{
    ss_devcuda *d = dev->ctx;
    int rc = current(d);
    if (rc < 0)
        return rc;
    *out = NULL;
    CALL(d, d->cu->cudaHostAlloc(out, n, SS_CUDA_HOST_ALLOC_PORTABLE),
         "cudaHostAlloc");
    return 0;
}

static void host_free(const ss_dev *dev, void *p, size_t n)
{
    ss_devcuda *d = dev->ctx;
    (void)n;
    if (p != NULL)
        (void)d->cu->cudaFreeHost(p);
}

static int stream_new(const ss_dev *dev, void **out)
{
    ss_devcuda *d = dev->ctx;
    ss_cudaStream_t s = NULL;
    int rc = current(d);
    if (rc < 0)
        return rc;
    CALL(d, d->cu->cudaStreamCreateWithFlags(&s, SS_CUDA_STREAM_NON_BLOCKING),
         "cudaStreamCreateWithFlags");
    *out = (void *)s;
    return 0;
}

static void stream_free(const ss_dev *dev, void *s)
{
    ss_devcuda *d = dev->ctx;
    if (s == NULL || current(d) < 0)
        return;
    (void)d->cu->cudaStreamSynchronize((ss_cudaStream_t)s);
    (void)d->cu->cudaStreamDestroy((ss_cudaStream_t)s);
}

static int stream_after(const ss_dev *dev, void *s, void *caller)
{
    ss_devcuda *d = dev->ctx;
    ss_cudaError_t e;
    const char *call = "cudaEventRecord";
    int rc = current(d);
    if (rc < 0)
        return rc;
    pthread_mutex_lock(
        &d->mu); /* one order event, used by one batch at a time */
    e = d->cu->cudaEventRecord(d->order, (ss_cudaStream_t)caller);
    if (e == SS_CUDA_SUCCESS) {
        call = "cudaStreamWaitEvent";
        e = d->cu->cudaStreamWaitEvent((ss_cudaStream_t)s, d->order, 0);
    }
    pthread_mutex_unlock(&d->mu);
    return e == SS_CUDA_SUCCESS ? 0 : fail(d, call, e);
}

static int event_new(const ss_dev *dev, void **out)
{
    ss_devcuda *d = dev->ctx;
    ss_cudaEvent_t ev = NULL;
    int rc = current(d);
    if (rc < 0)
        return rc;
    CALL(d, d->cu->cudaEventCreateWithFlags(&ev, SS_CUDA_EVENT_DISABLE_TIMING),
         "cudaEventCreateWithFlags");
    *out = (void *)ev;
    return 0;
}

static void event_free(const ss_dev *dev, void *ev)
{
    ss_devcuda *d = dev->ctx;
    if (ev != NULL)
        (void)d->cu->cudaEventDestroy((ss_cudaEvent_t)ev);
}

static int copy(const ss_dev *dev, void *dst, const void *src, size_t n,
                int kind, void *s)
{
    ss_devcuda *d = dev->ctx;
    int rc = current(d);
    if (rc < 0)
        return rc;
    if (kind != SS_DEV_D2H && kind != SS_DEV_H2D)
        return SS_EINVAL;
    CALL(d,
         d->cu->cudaMemcpyAsync(dst, src, n,
                                kind == SS_DEV_D2H
                                    ? SS_CUDA_MEMCPY_DEVICE_TO_HOST
                                    : SS_CUDA_MEMCPY_HOST_TO_DEVICE,
                                (ss_cudaStream_t)s),
         "cudaMemcpyAsync");
    return 0;
}

static int record(const ss_dev *dev, void *ev, void *s)
{
    ss_devcuda *d = dev->ctx;
    CALL(d, d->cu->cudaEventRecord((ss_cudaEvent_t)ev, (ss_cudaStream_t)s),
         "cudaEventRecord");
    return 0;
}

static int sync_event(const ss_dev *dev, void *ev)
{
    ss_devcuda *d = dev->ctx;
    CALL(d, d->cu->cudaEventSynchronize((ss_cudaEvent_t)ev),
         "cudaEventSynchronize");
    return 0;
}

static void describe(const ss_dev *dev, char *buf, size_t len)
{
    ss_devcuda *d = dev->ctx;
    pthread_mutex_lock(&d->mu);
    snprintf(buf, len, "%s", d->last);
    pthread_mutex_unlock(&d->mu);
}

int ss_devcuda_new(ss_devcuda **out, const ss_cuda *cu, int device,
                   ss_errinfo *err)
{
    ss_devcuda *d;
    int rc;

    *out = NULL;
    if (cu == NULL || device < 0)
        return SS_EINVAL;
    d = calloc(1, sizeof *d);
    if (d == NULL)
        return SS_ENOMEM;
    d->cu = cu;
    d->device = device;
    pthread_mutex_init(&d->mu, NULL);
    d->dev =
        (ss_dev){d,           "cuda",       host_alloc, host_free,  stream_new,
                 stream_free, stream_after, event_new,  event_free, copy,
                 record,      sync_event,   describe};
    rc = current(d);
    if (rc == 0) {
        void *ev = NULL;
        rc = event_new(&d->dev, &ev);
        d->order = (ss_cudaEvent_t)ev;
    }
    if (rc < 0) {
        ss_errinfo_set(err, rc, "cuda device", NULL, -1, "%s", d->last);
        ss_devcuda_free(d);
        return rc;
    }
    *out = d;
    return 0;
}

void ss_devcuda_free(ss_devcuda *d)
{
    if (d == NULL)
        return;
    if (d->order != NULL)
        (void)d->cu->cudaEventDestroy(d->order);
    pthread_mutex_destroy(&d->mu);
    free(d);
}

const ss_dev *ss_devcuda_dev(ss_devcuda *d)
{
    return &d->dev;
}
