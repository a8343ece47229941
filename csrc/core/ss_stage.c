/* ss_stage.c - see ss_stage.h.
 *
 * State under mu: the free-slot stack; for a write batch the items, the
 * next item to queue a copy for, and the slot each queued item holds
 * (NONE before, DONE after it is given back); `failed`, the first error.
 * Copies and records are queued under mu, so the stream sees them in item
 * order; waiting for an event (sync) happens outside it.
 */
#include "ss_stage.h"

#include "ss_error.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#define NONE SIZE_MAX
#define DONE (SIZE_MAX - 1)

struct ss_stage {
    const ss_dev *dev;
    size_t nbufs, bufsize;
    void **buf;
    void **ev;
    void *stream;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    size_t *free_slots;
    size_t nfree;
    int busy;   /* a batch is running */
    int failed; /* 0 or the first error of this batch */
    const ss_stage_item *items;
    size_t nitems, next;
    size_t *slot_of;
};

int ss_stage_new(ss_stage **out, const ss_dev *dev, size_t nbufs,
                 size_t bufsize)
{
    ss_stage *st = NULL;
    int rc = 0;

    *out = NULL;
    if (dev == NULL || nbufs < 1 || nbufs > 4096 || bufsize < 4096)
        return SS_EINVAL;
    st = calloc(1, sizeof *st);
    if (st == NULL)
        return SS_ENOMEM;
    st->dev = dev;
    st->nbufs = nbufs;
    st->bufsize = bufsize;
    pthread_mutex_init(&st->mu, NULL);
    pthread_cond_init(&st->cv, NULL);
    st->buf = calloc(nbufs, sizeof *st->buf);
    st->ev = calloc(nbufs, sizeof *st->ev);
    st->free_slots = calloc(nbufs, sizeof *st->free_slots);
    if (st->buf == NULL || st->ev == NULL || st->free_slots == NULL) {
        rc = SS_ENOMEM;
        goto out;
    }
    if ((rc = dev->stream_new(dev, &st->stream)) < 0)
        goto out;
    for (size_t i = 0; i < nbufs; i++) {
        if ((rc = dev->host_alloc(dev, bufsize, &st->buf[i])) < 0)
            goto out;
        if ((rc = dev->event_new(dev, &st->ev[i])) < 0)
            goto out;
        st->free_slots[st->nfree++] = i;
    }
out:
    if (rc < 0)
        ss_stage_free(st);
    else
        *out = st;
    return rc;
}

void ss_stage_free(ss_stage *st)
{
    if (st == NULL)
        return;
    if (st->stream != NULL)
        st->dev->stream_free(st->dev, st->stream); /* drains its queue */
    for (size_t i = 0; i < st->nbufs; i++) {
        if (st->ev != NULL && st->ev[i] != NULL)
            st->dev->event_free(st->dev, st->ev[i]);
        if (st->buf != NULL && st->buf[i] != NULL)
            st->dev->host_free(st->dev, st->buf[i], st->bufsize);
    }
    free(st->buf);
    free(st->ev);
    free(st->free_slots);
    pthread_cond_destroy(&st->cv);
    pthread_mutex_destroy(&st->mu);
    free(st);
}

size_t ss_stage_bufsize(const ss_stage *st)
{
    return st->bufsize;
}

size_t ss_stage_nbufs(const ss_stage *st)
{
    return st->nbufs;
}

void ss_stage_describe(const ss_stage *st, char *buf, size_t len)
{
    if (len == 0)
        return;
    buf[0] = '\0';
    if (st->dev->describe != NULL)
        st->dev->describe(st->dev, buf, len);
}

/* ---- batches ------------------------------------------------------------ */

static void fail_locked(ss_stage *st, int rc)
{
    if (st->failed == 0)
        st->failed = rc;
    pthread_cond_broadcast(&st->cv);
}

/* Batches take turns: wait for the running one to end. */
static int begin(ss_stage *st)
{
    pthread_mutex_lock(&st->mu);
    while (st->busy)
        pthread_cond_wait(&st->cv, &st->mu);
    st->busy = 1;
    st->failed = 0;
    pthread_mutex_unlock(&st->mu);
    return 0;
}

/* Queue copies for the next items while there are free buffers. */
static void issue_locked(ss_stage *st)
{
    const ss_dev *dev = st->dev;
    while (st->failed == 0 && st->next < st->nitems && st->nfree > 0) {
        const ss_stage_item *it = &st->items[st->next];
        size_t slot = st->free_slots[--st->nfree];
        int rc = dev->copy(dev, st->buf[slot], it->dev, it->len, SS_DEV_D2H,
                           st->stream);
        if (rc == 0)
            rc = dev->record(dev, st->ev[slot], st->stream);
        if (rc < 0) {
            st->free_slots[st->nfree++] = slot;
            fail_locked(st, rc);
            return;
        }
        st->slot_of[st->next++] = slot;
    }
}

int ss__stage_begin_d2h(ss_stage *st, const ss_stage_item *items, size_t n,
                        void *caller_stream)
{
    int rc = begin(st);
    if (rc < 0)
        return rc;
    for (size_t i = 0; i < n; i++)
        if (items[i].len > st->bufsize)
            rc = SS_EINVAL;
    if (rc == 0) {
        st->slot_of = malloc((n ? n : 1) * sizeof *st->slot_of);
        rc = st->slot_of == NULL ? SS_ENOMEM : 0;
    }
    if (rc == 0)
        rc = st->dev->stream_after(st->dev, st->stream, caller_stream);
    pthread_mutex_lock(&st->mu);
    if (rc < 0) { /* no batch after all */
        free(st->slot_of);
        st->slot_of = NULL;
        st->busy = 0;
        pthread_cond_broadcast(&st->cv);
    } else {
        st->items = items;
        st->nitems = n;
        st->next = 0;
        for (size_t i = 0; i < n; i++)
            st->slot_of[i] = NONE;
        issue_locked(st); /* the first copies start now */
    }
    pthread_mutex_unlock(&st->mu);
    return rc;
}

int ss__stage_take(ss_stage *st, size_t k, const void **host)
{
    size_t slot = NONE;
    int rc = 0;

    pthread_mutex_lock(&st->mu);
    if (k >= st->nitems) {
        rc = SS_EINVAL;
        goto out;
    }
    for (;;) {
        if (st->failed) {
            rc = st->failed;
            goto out;
        }
        if (st->slot_of[k] != NONE)
            break;
        issue_locked(st);
        if (st->slot_of[k] == NONE && !st->failed)
            pthread_cond_wait(&st->cv, &st->mu);
    }
    slot = st->slot_of[k];
    if (slot == DONE)
        rc = SS_EINVAL; /* taken twice */
out:
    pthread_mutex_unlock(&st->mu);
    if (rc < 0)
        return rc;
    rc = st->dev->sync(st->dev, st->ev[slot]);
    if (rc < 0) {
        ss__stage_cancel(st);
        return rc;
    }
    *host = st->buf[slot];
    return 0;
}

void ss__stage_give(ss_stage *st, size_t k)
{
    pthread_mutex_lock(&st->mu);
    if (k < st->nitems && st->slot_of[k] != NONE && st->slot_of[k] != DONE) {
        st->free_slots[st->nfree++] = st->slot_of[k];
        st->slot_of[k] = DONE;
        issue_locked(st); /* copy ahead into the buffer just freed */
        pthread_cond_broadcast(&st->cv);
    }
    pthread_mutex_unlock(&st->mu);
}

int ss__stage_begin_h2d(ss_stage *st)
{
    int rc = begin(st);
    if (rc == 0) {
        st->items = NULL;
        st->nitems = st->next = 0;
        st->slot_of = NULL;
    }
    return rc;
}

int ss__stage_buffer(ss_stage *st, void **host, size_t *slot)
{
    int rc = 0;
    pthread_mutex_lock(&st->mu);
    while (st->nfree == 0 && !st->failed)
        pthread_cond_wait(&st->cv, &st->mu);
    if (st->failed)
        rc = st->failed;
    else
        *slot = st->free_slots[--st->nfree];
    pthread_mutex_unlock(&st->mu);
    if (rc < 0)
        return rc;
    /* Its previous host-to-device copy must be done before we refill it. */
    rc = st->dev->sync(st->dev, st->ev[*slot]);
    if (rc < 0) {
        ss__stage_put(st, *slot);
        ss__stage_cancel(st);
        return rc;
    }
    *host = st->buf[*slot];
    return 0;
}

int ss__stage_h2d(ss_stage *st, size_t slot, void *dev, size_t len)
{
    const ss_dev *d = st->dev;
    int rc;
    pthread_mutex_lock(&st->mu);
    rc = st->failed;
    if (rc == 0 && (slot >= st->nbufs || len > st->bufsize))
        rc = SS_EINVAL;
    if (rc == 0)
        rc = d->copy(d, dev, st->buf[slot], len, SS_DEV_H2D, st->stream);
    if (rc == 0)
        rc = d->record(d, st->ev[slot], st->stream);
    if (rc < 0)
        fail_locked(st, rc);
    if (slot < st->nbufs)
        st->free_slots[st->nfree++] = slot;
    pthread_cond_broadcast(&st->cv);
    pthread_mutex_unlock(&st->mu);
    return rc;
}

void ss__stage_put(ss_stage *st, size_t slot)
{
    pthread_mutex_lock(&st->mu);
    if (slot < st->nbufs)
        st->free_slots[st->nfree++] = slot;
    pthread_cond_broadcast(&st->cv);
    pthread_mutex_unlock(&st->mu);
}

void ss__stage_cancel(ss_stage *st)
{
    pthread_mutex_lock(&st->mu);
    fail_locked(st, SS_ECANCELED);
    pthread_mutex_unlock(&st->mu);
}

int ss__stage_end(ss_stage *st)
{
    int rc = 0;
    /* Every thread of the batch is done: wait for the copies still queued
     * (one stream, so waiting on every buffer's event waits for all). */
    for (size_t i = 0; i < st->nbufs; i++) {
        int r = st->dev->sync(st->dev, st->ev[i]);
        if (r < 0 && rc == 0)
            rc = r;
    }
    pthread_mutex_lock(&st->mu);
    if (st->failed != 0 && st->failed != SS_ECANCELED && rc == 0)
        rc = st->failed;
    st->nfree = 0;
    for (size_t i = 0; i < st->nbufs; i++)
        st->free_slots[st->nfree++] = i;
    free(st->slot_of);
    st->slot_of = NULL;
    st->items = NULL;
    st->nitems = st->next = 0;
    st->failed = 0;
    st->busy = 0;
    pthread_cond_broadcast(&st->cv); /* the next batch may begin */
    pthread_mutex_unlock(&st->mu);
    return rc;
}
