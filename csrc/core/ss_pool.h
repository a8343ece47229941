/* ss_pool.h - a fixed-size thread pool that runs parallel-for batches.
 *
 * ss_pool_run(p, n, fn, ctx) calls fn(ctx, i) once for every i in [0, n)
 * and returns when all calls have returned. Indices are handed out in
 * increasing order to whichever thread is free, so tasks should be of
 * similar size (split big work into pieces). The calling thread works on
 * its own batch too, so a pool of 0 threads is valid and runs serially,
 * and so is p == NULL.
 *
 * Thread safety: any number of threads may call ss_pool_run on one pool at
 * once; their batches share the workers first come, first served. fn must
 * not call ss_pool_run on the same pool (it would still finish, because the
 * caller always helps, but it serialises). ss_pool_free must not race with
 * ss_pool_run. Tasks cannot fail through the pool: a task records its own
 * error in ctx (first error wins) and later tasks may check it and skip.
 */
#ifndef SS_POOL_H
#define SS_POOL_H

#include <stddef.h>

typedef struct ss_pool ss_pool;
typedef void (*ss_task_fn)(void *ctx, size_t index);

#define SS_POOL_MAX_THREADS 1024

/* Start nthreads workers (0..SS_POOL_MAX_THREADS). 0 or -errno / SS_E*. */
int ss_pool_new(ss_pool **out, int nthreads);

/* Stop and join the workers. NULL is a no-op. */
void ss_pool_free(ss_pool *p);

/* Number of worker threads (0 for NULL). */
int ss_pool_threads(const ss_pool *p);

/* Run fn(ctx, i) for i in [0, n); blocks until all are done. Always 0. */
int ss_pool_run(ss_pool *p, size_t n, ss_task_fn fn, void *ctx);

#endif /* SS_POOL_H */
