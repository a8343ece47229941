/* ss_pool.c - thread pool with a FIFO of parallel-for batches.
 *
 * Invariants (under p->mu): every batch on the list has next <= n and
 * done <= next; a batch leaves the list only when done == n, removed by the
 * thread that submitted it. Workers sleep on work_cv when no listed batch
 * has an unclaimed index; submitters sleep on done_cv until their batch is
 * complete.
 */
#include "ss_pool.h"
#include "ss_error.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>

typedef struct batch {
    ss_task_fn fn;
    void *ctx;
    size_t n;
    size_t next; /* first unclaimed index */
    size_t done; /* finished calls */
    struct batch *link;
} batch;

struct ss_pool {
    pthread_mutex_t mu;
    pthread_cond_t work_cv;
    pthread_cond_t done_cv;
    batch *head; /* oldest first */
    int stopping;
    int nthreads;
    pthread_t *threads;
};

/* First batch with unclaimed work, or NULL. Caller holds mu. */
static batch *claimable(ss_pool *p)
{
    for (batch *b = p->head; b != NULL; b = b->link)
        if (b->next < b->n)
            return b;
    return NULL;
}

/* Claim and run one index of b; called and returns with mu held. */
static void run_one(ss_pool *p, batch *b)
{
    size_t i = b->next++;
    pthread_mutex_unlock(&p->mu);
    b->fn(b->ctx, i);
    pthread_mutex_lock(&p->mu);
    if (++b->done == b->n)
        pthread_cond_broadcast(&p->done_cv);
}

static void *worker_main(void *arg)
{
    ss_pool *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        batch *b = claimable(p);
        if (b != NULL) {
            run_one(p, b);
            continue;
        }
        if (p->stopping)
            break;
        pthread_cond_wait(&p->work_cv, &p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void stop_and_join(ss_pool *p, int started)
{
    pthread_mutex_lock(&p->mu);
    p->stopping = 1;
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < started; i++)
        pthread_join(p->threads[i], NULL);
}

int ss_pool_new(ss_pool **out, int nthreads)
{
    int rc = 0, started = 0;
    ss_pool *p = NULL;

    *out = NULL;
    if (nthreads < 0 || nthreads > SS_POOL_MAX_THREADS)
        return SS_EINVAL;
    p = calloc(1, sizeof *p);
    if (p == NULL)
        return SS_ENOMEM;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work_cv, NULL);
    pthread_cond_init(&p->done_cv, NULL);
    if (nthreads > 0) {
        p->threads = calloc((size_t)nthreads, sizeof *p->threads);
        if (p->threads == NULL) {
            rc = SS_ENOMEM;
            goto out;
        }
    }
    for (; started < nthreads; started++) {
        int err = pthread_create(&p->threads[started], NULL, worker_main, p);
        if (err != 0) {
            rc = -err;
            goto out;
        }
    }
    p->nthreads = nthreads;
    *out = p;
    p = NULL;
out:
    if (p != NULL) {
        stop_and_join(p, started);
        pthread_cond_destroy(&p->done_cv);
        pthread_cond_destroy(&p->work_cv);
        pthread_mutex_destroy(&p->mu);
        free(p->threads);
        free(p);
    }
    return rc;
}

void ss_pool_free(ss_pool *p)
{
    if (p == NULL)
        return;
    stop_and_join(p, p->nthreads);
    pthread_cond_destroy(&p->done_cv);
    pthread_cond_destroy(&p->work_cv);
    pthread_mutex_destroy(&p->mu);
    free(p->threads);
    free(p);
}

int ss_pool_threads(const ss_pool *p)
{
    return p == NULL ? 0 : p->nthreads;
}

int ss_pool_run(ss_pool *p, size_t n, ss_task_fn fn, void *ctx)
{
    if (n == 0)
        return 0;
    if (p == NULL || p->nthreads == 0 || n == 1) {
        for (size_t i = 0; i < n; i++)
            fn(ctx, i);
        return 0;
    }

    batch b = {fn, ctx, n, 0, 0, NULL};
    batch **tail;

    pthread_mutex_lock(&p->mu);
    for (tail = &p->head; *tail != NULL; tail = &(*tail)->link)
        ;
    *tail = &b;
    pthread_cond_broadcast(&p->work_cv);
    while (b.next < b.n) /* the submitter helps with its own batch */
        run_one(p, &b);
    while (b.done < b.n)
        pthread_cond_wait(&p->done_cv, &p->mu);
    for (tail = &p->head; *tail != &b; tail = &(*tail)->link)
        ;
    *tail = b.link;
    pthread_mutex_unlock(&p->mu);
    return 0;
}
