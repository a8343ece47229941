/* test_pool.c - the thread pool runs every index exactly once, from one
 * caller or many at once, and 0-thread / NULL pools run serially. */
#include "ss_error.h"
#include "ss_pool.h"
#include "ss_test.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

typedef struct {
    atomic_int *hits;
} hits_ctx;

static void hit(void *ctx, size_t i)
{
    atomic_fetch_add(&((hits_ctx *)ctx)->hits[i], 1);
}

static void check_all_once(ss_pool *p, size_t n)
{
    atomic_int *hits = calloc(n ? n : 1, sizeof *hits);
    hits_ctx c = {hits};
    CHECK_EQ_INT(ss_pool_run(p, n, hit, &c), 0);
    for (size_t i = 0; i < n; i++)
        CHECK_EQ_INT(atomic_load(&hits[i]), 1);
    free(hits);
}

static void test_sizes(void)
{
    int sizes[] = {0, 1, 2, 7};
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
        ss_pool *p = NULL;
        CHECK_EQ_INT(ss_pool_new(&p, sizes[k]), 0);
        CHECK_EQ_INT(ss_pool_threads(p), sizes[k]);
        check_all_once(p, 0);
        check_all_once(p, 1);
        check_all_once(p, 1000);
        ss_pool_free(p);
    }
    check_all_once(NULL, 10);
    ss_pool_free(NULL);
}

static void test_bad_size(void)
{
    ss_pool *p = (ss_pool *)1;
    CHECK_EQ_INT(ss_pool_new(&p, -1), SS_EINVAL);
    CHECK(p == NULL);
    CHECK_EQ_INT(ss_pool_new(&p, SS_POOL_MAX_THREADS + 1), SS_EINVAL);
}

static ss_pool *shared_pool;

static void *submitter(void *arg)
{
    (void)arg;
    for (int r = 0; r < 50; r++)
        check_all_once(shared_pool, 257);
    return NULL;
}

static void test_concurrent_callers(void)
{
    pthread_t t[4];
    CHECK_EQ_INT(ss_pool_new(&shared_pool, 3), 0);
    for (int i = 0; i < 4; i++)
        pthread_create(&t[i], NULL, submitter, NULL);
    for (int i = 0; i < 4; i++)
        pthread_join(t[i], NULL);
    ss_pool_free(shared_pool);
}

int main(void)
{
    RUN(test_sizes);
    RUN(test_bad_size);
    RUN(test_concurrent_callers);
    return ss_test_report("pool");
}
