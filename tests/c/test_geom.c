/* test_geom.c - the box index against a brute-force double loop on random
 * boxes and tilings, the strided copy against a naive element loop, and
 * the error cases of both. */
#include "ss_error.h"
#include "ss_geom.h"
#include "ss_pool.h"
#include "ss_test.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Compare an index query to the double loop; returns 1 when equal. */
static int matches_brute(int nd, size_t n, const int64_t *off,
                         const int64_t *sz, const int64_t *qo,
                         const int64_t *qs, const ss_overlaps *o)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        int hit = 1;
        int64_t lo[SS_GEOM_MAX_NDIM], hi[SS_GEOM_MAX_NDIM];
        for (int d = 0; d < nd; d++) {
            int64_t a = off[i * nd + d], b = a + sz[i * nd + d];
            lo[d] = a > qo[d] ? a : qo[d];
            hi[d] = b < qo[d] + qs[d] ? b : qo[d] + qs[d];
            if (lo[d] >= hi[d])
                hit = 0;
        }
        if (!hit)
            continue;
        if (k >= o->count || o->saved_index[k] != (int64_t)i)
            return 0;
        for (int d = 0; d < nd; d++) {
            if (o->saved_offset[k * nd + d] != lo[d] - off[i * nd + d] ||
                o->request_offset[k * nd + d] != lo[d] - qo[d] ||
                o->lengths[k * nd + d] != hi[d] - lo[d])
                return 0;
        }
        k++;
    }
    return k == o->count;
}

static void test_random_boxes(void)
{
    ss_overlaps o;
    ss_overlaps_init(&o);
    for (int trial = 0; trial < 300; trial++) {
        int nd = (int)rnd_in(0, 4);
        size_t n = (size_t)rnd_in(0, 60);
        int64_t *off = malloc((n * nd + 1) * sizeof *off);
        int64_t *sz = malloc((n * nd + 1) * sizeof *sz);
        int64_t qo[4], qs[4];
        ss_geom_index *ix = NULL;
        for (size_t i = 0; i < n * nd; i++) {
            off[i] = rnd_in(0, 20);
            sz[i] = rnd_in(0, 8);
        }
        if (n > 2) /* a replica */
            for (int d = 0; d < nd; d++) {
                off[nd + d] = off[d];
                sz[nd + d] = sz[d];
            }
        CHECK_EQ_INT(ss_geom_index_new(&ix, nd, n, off, sz, NULL), 0);
        CHECK_EQ_INT(ss_geom_index_count(ix), n);
        for (int q = 0; q < 20; q++) {
            for (int d = 0; d < nd; d++) {
                qo[d] = rnd_in(0, 24);
                qs[d] = rnd_in(0, 12);
            }
            CHECK_EQ_INT(ss_geom_query(ix, qo, qs, &o, NULL), 0);
            CHECK(matches_brute(nd, n, off, sz, qo, qs, &o));
        }
        ss_geom_index_free(ix);
        free(off);
        free(sz);
    }
    ss_overlaps_destroy(&o);
}

/* Row-wise tiling of 10000 chunks: a one-row request visits few nodes. */
static void test_tiling_visits_few(void)
{
    size_t n = 10000;
    int64_t *off = malloc(2 * n * sizeof *off);
    int64_t *sz = malloc(2 * n * sizeof *sz);
    ss_geom_index *ix = NULL;
    ss_overlaps o;
    int64_t qo[2] = {5000 * 3 + 1, 0}, qs[2] = {4, 7};
    ss_overlaps_init(&o);
    for (size_t i = 0; i < n; i++) {
        off[2 * i] = (int64_t)i * 3;
        sz[2 * i] = 3;
        off[2 * i + 1] = 0;
        sz[2 * i + 1] = 7;
    }
    CHECK_EQ_INT(ss_geom_index_new(&ix, 2, n, off, sz, NULL), 0);
    CHECK_EQ_INT(ss_geom_query(ix, qo, qs, &o, NULL), 0);
    CHECK_EQ_INT(o.count, 2);
    CHECK_EQ_INT(o.saved_index[0], 5000);
    CHECK_EQ_INT(o.saved_index[1], 5001);
    CHECK(o.visited < 200);
    CHECK(matches_brute(2, n, off, sz, qo, qs, &o));
    ss_geom_index_free(ix);
    ss_overlaps_destroy(&o);
    free(off);
    free(sz);
}

static void test_query_many_and_scalar(void)
{
    int64_t off[4] = {0, 4, 2, 6}, sz[4] = {4, 4, 4, 0};
    int64_t qo[3] = {3, 9, 0}, qs[3] = {2, 1, 10};
    ss_geom_index *ix = NULL;
    ss_overlaps o;
    ss_overlaps_init(&o);
    CHECK_EQ_INT(ss_geom_index_new(&ix, 1, 4, off, sz, NULL), 0);
    CHECK_EQ_INT(ss_geom_query_many(ix, 3, qo, qs, &o, NULL), 0);
    /* request 0 -> boxes 0, 1, 2; request 1 -> none; request 2 -> 0, 1, 2 */
    CHECK_EQ_INT(o.count, 6);
    CHECK_EQ_INT(o.request_index[0], 0);
    CHECK_EQ_INT(o.request_index[3], 2);
    CHECK_EQ_INT(o.saved_index[2], 2);
    CHECK_EQ_INT(o.lengths[1], 1); /* box 1 [4, 8) & [3, 5) */
    ss_geom_index_free(ix);

    /* ndim 0: every box holds the one point. */
    CHECK_EQ_INT(ss_geom_index_new(&ix, 0, 3, NULL, NULL, NULL), 0);
    CHECK_EQ_INT(ss_geom_query(ix, NULL, NULL, &o, NULL), 0);
    CHECK_EQ_INT(o.count, 3);
    CHECK_EQ_INT(o.saved_index[2], 2);
    ss_geom_index_free(ix);
    ss_overlaps_destroy(&o);
}

static void test_geom_errors(void)
{
    int64_t off[2] = {0, -1}, sz[2] = {1, 1}, big[1] = {INT64_MAX};
    ss_geom_index *ix = (ss_geom_index *)1;
    ss_errinfo e;
    ss_overlaps o;
    ss_overlaps_init(&o);
    ss_errinfo_clear(&e);
    CHECK_EQ_INT(ss_geom_index_new(&ix, 1, 2, off, sz, &e), SS_EINVAL);
    CHECK(ix == NULL);
    CHECK(strstr(e.detail, "box 1") != NULL);
    CHECK_EQ_INT(ss_geom_index_new(&ix, 1, 1, big, sz, NULL), SS_EINVAL);
    CHECK_EQ_INT(ss_geom_index_new(&ix, 65, 0, NULL, NULL, NULL), SS_EINVAL);
    CHECK_EQ_INT(ss_geom_index_new(&ix, 1, 1, off, sz, NULL), 0);
    ss_errinfo_clear(&e);
    CHECK_EQ_INT(ss_geom_query_many(ix, 2, off, sz, &o, &e), SS_EINVAL);
    CHECK_EQ_INT(e.job, 1);
    CHECK_EQ_INT(o.count, 0);
    ss_geom_index_free(ix);
    ss_geom_index_free(NULL);
    ss_overlaps_destroy(&o);
}

/* ---- copy ---- */

static void naive_copy(char *dst, const int64_t *ds, const char *src,
                       const int64_t *ss, const int64_t *sizes, int nd,
                       size_t el)
{
    int64_t idx[8] = {0}, total = 1;
    for (int d = 0; d < nd; d++)
        total *= sizes[d];
    for (int64_t e = 0; e < total; e++) {
        int64_t r = e, doff = 0, soff = 0;
        for (int d = nd - 1; d >= 0; d--) {
            idx[d] = r % sizes[d];
            r /= sizes[d];
            doff += idx[d] * ds[d];
            soff += idx[d] * ss[d];
        }
        memcpy(dst + doff, src + soff, el);
    }
}

/* A random strided layout of sizes inside a buffer: a permuted dense
 * layout with padding and random flips. Returns the base offset. */
static int64_t random_layout(const int64_t *sizes, int nd, size_t el,
                             int64_t *strides, int64_t *span)
{
    int perm[8];
    int64_t step = (int64_t)el * rnd_in(1, 2), base = 0;
    for (int d = 0; d < nd; d++)
        perm[d] = d;
    for (int d = nd - 1; d > 0; d--) {
        int j = (int)rnd_in(0, d), t = perm[d];
        perm[d] = perm[j];
        perm[j] = t;
    }
    for (int k = nd - 1; k >= 0; k--) {
        int d = perm[k];
        strides[d] = step;
        step *= sizes[d] + rnd_in(0, 1);
    }
    for (int d = 0; d < nd; d++)
        if (rnd() % 4 == 0) {
            base += (sizes[d] - 1) * strides[d];
            strides[d] = -strides[d];
        }
    *span = step + (int64_t)el;
    return base;
}

static void check_copy_case(ss_pool *pool, int nd, const int64_t *sizes,
                            size_t el)
{
    int64_t ds[8], ss[8], dspan, sspan;
    int64_t dbase = random_layout(sizes, nd, el, ds, &dspan);
    int64_t sbase = random_layout(sizes, nd, el, ss, &sspan);
    char *src = malloc((size_t)sspan), *a = malloc((size_t)dspan),
         *b = malloc((size_t)dspan);
    for (int64_t i = 0; i < sspan; i++)
        src[i] = (char)rnd();
    for (int64_t i = 0; i < dspan; i++)
        a[i] = b[i] = (char)rnd();
    CHECK_EQ_INT(
        ss_copy_nd(pool, a + dbase, ds, src + sbase, ss, sizes, nd, el, NULL),
        0);
    naive_copy(b + dbase, ds, src + sbase, ss, sizes, nd, el);
    CHECK(memcmp(a, b, (size_t)dspan) == 0);
    free(src);
    free(a);
    free(b);
}

static void test_copy_random(void)
{
    size_t els[] = {1, 2, 3, 4, 8, 12, 16};
    ss_pool *pool = NULL;
    CHECK_EQ_INT(ss_pool_new(&pool, 2), 0);
    for (int trial = 0; trial < 400; trial++) {
        int nd = (int)rnd_in(0, 4);
        int64_t sizes[4];
        for (int d = 0; d < nd; d++)
            sizes[d] = rnd_in(0, 7);
        check_copy_case(trial % 2 ? pool : NULL, nd, sizes,
                        els[rnd() % (sizeof els / sizeof *els)]);
    }
    /* Dims long enough for the tiled (transposing) path. */
    for (int trial = 0; trial < 150; trial++) {
        int nd = (int)rnd_in(2, 3);
        int64_t sizes[3];
        for (int d = 0; d < nd; d++)
            sizes[d] = rnd_in(1, 80);
        check_copy_case(trial % 2 ? pool : NULL, nd, sizes,
                        els[rnd() % (sizeof els / sizeof *els)]);
    }
    /* Large enough to be split over the pool, strided and contiguous. */
    {
        int64_t s2[2] = {700, 1000}, s3[3] = {64, 130, 97};
        check_copy_case(pool, 2, s2, 4);
        check_copy_case(pool, 3, s3, 8);
        check_copy_case(pool, 2, s2, 3);
    }
    ss_pool_free(pool);
}

static void test_copy_errors(void)
{
    char buf[64] = {0};
    int64_t st[2] = {8, 1}, zero[2] = {0, 1}, sz[2] = {2, 4}, neg[2] = {-1, 4};
    int64_t huge[2] = {INT64_MAX / 2 + 1, 1}, hsz[2] = {3, 1};
    ss_errinfo e;
    CHECK_EQ_INT(ss_copy_nd(NULL, buf, st, buf + 32, st, sz, 2, 1, NULL), 0);
    CHECK_EQ_INT(ss_copy_nd(NULL, buf, st, buf + 4, st, sz, 2, 1, NULL),
                 SS_EOVERLAP);
    CHECK_EQ_INT(ss_copy_nd(NULL, buf, st, buf, st, sz, 2, 1, NULL), 0);
    CHECK_EQ_INT(ss_copy_nd(NULL, buf, zero, buf + 32, st, sz, 2, 1, NULL),
                 SS_EINVAL);
    CHECK_EQ_INT(ss_copy_nd(NULL, buf, st, buf + 32, st, neg, 2, 1, NULL),
                 SS_EINVAL);
    CHECK_EQ_INT(ss_copy_nd(NULL, buf, st, buf + 32, st, sz, 2, 0, NULL),
                 SS_EINVAL);
    CHECK_EQ_INT(ss_copy_nd(NULL, buf, st, buf + 32, st, sz, 65, 1, NULL),
                 SS_EINVAL);
    ss_errinfo_clear(&e);
    CHECK_EQ_INT(ss_copy_nd(NULL, buf, huge, buf + 32, st, hsz, 2, 1, &e),
                 SS_ERANGE);
    CHECK_EQ_INT(e.code, SS_ERANGE);
    CHECK_EQ_INT(ss_copy_nd(NULL, NULL, st, buf, st, sz, 2, 1, NULL),
                 SS_EINVAL);
    /* An empty region needs no buffers at all. */
    sz[0] = 0;
    CHECK_EQ_INT(ss_copy_nd(NULL, NULL, st, NULL, st, sz, 2, 1, NULL), 0);
}

int main(void)
{
    RUN(test_random_boxes);
    RUN(test_tiling_visits_few);
    RUN(test_query_many_and_scalar);
    RUN(test_geom_errors);
    RUN(test_copy_random);
    RUN(test_copy_errors);
    return ss_test_report("geom");
}
