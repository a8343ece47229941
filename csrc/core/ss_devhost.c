/* ss_devhost.c - see ss_devhost.h.
 *
 * A stream is a thread with a FIFO of copies. Each queued copy takes a
 * ticket (1, 2, ...); `done` is the ticket of the last copy finished. An
 * event remembers its stream and the last ticket queued when it was
 * recorded; sync waits until done reaches it.
 */
#include "ss_devhost.h"

#include "ss_copy.h"
#include "ss_error.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

struct ss_devhost {
    ss_dev dev;
    atomic_uint delay_us;
    atomic_long fail_at; /* issued count at which a copy fails; 0 = off */
    atomic_int fail_code;
    atomic_long issued;
    atomic_long completed;
    atomic_long max_inflight;
};

typedef struct op {
    struct op *next;
    void *dst;
    const void *src;
    size_t n;
} op;

typedef struct {
    ss_devhost *h;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    op *head, *tail;
    uint64_t queued, done; /* tickets */
    int stop;
    pthread_t thread;
} stream;

typedef struct {
    stream *s; /* NULL until recorded */
    uint64_t ticket;
} event;

static void sleep_us(unsigned us)
{
    struct timespec ts = {us / 1000000u, (long)(us % 1000000u) * 1000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

static void *stream_main(void *arg)
{
    stream *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (s->head == NULL && !s->stop)
            pthread_cond_wait(&s->cv, &s->mu);
        if (s->head == NULL) /* stopped and drained */
            break;
        op *o = s->head;
        s->head = o->next;
        if (s->head == NULL)
            s->tail = NULL;
        pthread_mutex_unlock(&s->mu);
        unsigned us = atomic_load(&s->h->delay_us);
        if (us)
            sleep_us(us);
        ss_copy(o->dst, o->src, o->n);
        free(o);
        atomic_fetch_add(&s->h->completed, 1);
        pthread_mutex_lock(&s->mu);
        s->done++;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static int host_alloc(const ss_dev *dev, size_t n, void **out)
{
    (void)dev;
    *out = aligned_alloc(64, (n + 63) / 64 * 64 + 64);
    return *out != NULL ? 0 : SS_ENOMEM;
}

static void host_free(const ss_dev *dev, void *p, size_t n)
{
    (void)dev;
    (void)n;
    free(p);
}

static int stream_new(const ss_dev *dev, void **out)
{
    stream *s = calloc(1, sizeof *s);
    int rc;
    if (s == NULL)
        return SS_ENOMEM;
    s->h = dev->ctx;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    rc = pthread_create(&s->thread, NULL, stream_main, s);
    if (rc != 0) {
        pthread_cond_destroy(&s->cv);
        pthread_mutex_destroy(&s->mu);
        free(s);
        return -rc;
    }
    *out = s;
    return 0;
}

static void stream_free(const ss_dev *dev, void *vs)
{
    stream *s = vs;
    (void)dev;
    if (s == NULL)
        return;
    pthread_mutex_lock(&s->mu);
    s->stop = 1; /* the thread finishes what is queued first */
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

static int stream_after(const ss_dev *dev, void *s, void *caller)
{
    (void)dev;
    (void)s;
    (void)caller; /* one host "device": nothing runs outside our streams */
    return 0;
}

static int event_new(const ss_dev *dev, void **out)
{
    (void)dev;
    *out = calloc(1, sizeof(event));
    return *out != NULL ? 0 : SS_ENOMEM;
}

static void event_free(const ss_dev *dev, void *e)
{
    (void)dev;
    free(e);
}

static int copy(const ss_dev *dev, void *dst, const void *src, size_t n,
                int kind, void *vs)
{
    ss_devhost *h = dev->ctx;
    stream *s = vs;
    long k = atomic_fetch_add(&h->issued, 1) + 1;
    long at = atomic_load(&h->fail_at);
    op *o;

    if (kind != SS_DEV_D2H && kind != SS_DEV_H2D)
        return SS_EINVAL;
    if (at != 0 && k == at) {
        atomic_fetch_sub(&h->issued, 1);
        return atomic_load(&h->fail_code);
    }
    o = malloc(sizeof *o);
    if (o == NULL) {
        atomic_fetch_sub(&h->issued, 1);
        return SS_ENOMEM;
    }
    *o = (op){NULL, dst, src, n};
    pthread_mutex_lock(&s->mu);
    if (s->tail != NULL)
        s->tail->next = o;
    else
        s->head = o;
    s->tail = o;
    s->queued++;
    long inflight = (long)(s->queued - s->done);
    long m = atomic_load(&h->max_inflight);
    while (inflight > m &&
           !atomic_compare_exchange_weak(&h->max_inflight, &m, inflight))
        ;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

static int record(const ss_dev *dev, void *ve, void *vs)
{
    event *e = ve;
    stream *s = vs;
    (void)dev;
    pthread_mutex_lock(&s->mu);
    e->s = s;
    e->ticket = s->queued;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

static int sync_event(const ss_dev *dev, void *ve)
{
    event *e = ve;
    (void)dev;
    /* e->s and e->ticket change only under the stage's lock, which the
     * caller held when it last recorded; reading them here is ordered by
     * that lock's release. */
    stream *s = e->s;
    if (s == NULL)
        return 0;
    pthread_mutex_lock(&s->mu);
    while (s->done < e->ticket)
        pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

int ss_devhost_new(ss_devhost **out)
{
    ss_devhost *h = calloc(1, sizeof *h);
    if (h == NULL)
        return SS_ENOMEM;
    h->dev =
        (ss_dev){h,           "host",       host_alloc, host_free,  stream_new,
                 stream_free, stream_after, event_new,  event_free, copy,
                 record,      sync_event,   NULL};
    *out = h;
    return 0;
}

void ss_devhost_free(ss_devhost *h)
{
    free(h);
}

const ss_dev *ss_devhost_dev(ss_devhost *h)
{
    return &h->dev;
}

void ss_devhost_set_delay(ss_devhost *h, unsigned us)
{
    atomic_store(&h->delay_us, us);
}

void ss_devhost_fail_copy(ss_devhost *h, long k, int code)
{
    atomic_store(&h->fail_code, code);
    atomic_store(&h->fail_at, k > 0 ? atomic_load(&h->issued) + k : 0);
}

long ss_devhost_issued(ss_devhost *h)
{
    return atomic_load(&h->issued);
}

long ss_devhost_completed(ss_devhost *h)
{
    return atomic_load(&h->completed);
}

long ss_devhost_max_inflight(ss_devhost *h)
{
    return atomic_load(&h->max_inflight);
}
