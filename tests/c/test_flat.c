/* test_flat.c - the FSDP flat-parameter layout against values torch 2.13's
 * FlatParamHandle produces, the shard infos against a brute-force element
 * walk, flatten/unflatten against a naive full-buffer reference (serial and
 * on a pool, many jobs at once), and the error cases. */
#include "ss_error.h"
#include "ss_flat.h"
#include "ss_pool.h"
#include "ss_test.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static ss_flat_layout *make(size_t n, const int64_t *numels, int64_t ws,
                            int64_t align)
{
    ss_flat_layout *l = NULL;
    CHECK_EQ_INT(ss_flat_layout_new(&l, n, numels, ws, align, NULL), 0);
    return l;
}

static void check_info(const ss_flat_info *f, int in, int64_t off, int64_t n,
                       int64_t s, int64_t e)
{
    CHECK_EQ_INT(f->in_shard, in);
    CHECK_EQ_INT(f->offset_in_shard, off);
    CHECK_EQ_INT(f->numel_in_shard, n);
    CHECK_EQ_INT(f->intra_start, s);
    CHECK_EQ_INT(f->intra_end, e);
}

/* Linear(3, 5) + Linear(5, 1), use_orig_params=True, float32, world size 3:
 * values printed by torch 2.13's FlatParamHandle.shard(). */
static void test_layout_aligned_torch_values(void)
{
    const int64_t numels[] = {15, 5, 5, 1};
    const int64_t segs[] = {15, 1, 5, 3, 5, 3, 1};
    const unsigned char pad[] = {0, 1, 0, 1, 0, 1, 0};
    ss_flat_layout *l = make(4, numels, 3, 4);
    ss_flat_info f[4];
    int64_t s, e;

    if (l == NULL)
        return;
    CHECK_EQ_INT(ss_flat_nsegments(l), 7);
    for (int i = 0; i < 7; i++) {
        CHECK_EQ_INT(ss_flat_segment_numels(l)[i], segs[i]);
        CHECK_EQ_INT(ss_flat_segment_is_padding(l)[i], pad[i]);
    }
    CHECK_EQ_INT(ss_flat_offsets(l)[0], 0);
    CHECK_EQ_INT(ss_flat_offsets(l)[1], 16);
    CHECK_EQ_INT(ss_flat_offsets(l)[2], 24);
    CHECK_EQ_INT(ss_flat_offsets(l)[3], 32);
    CHECK_EQ_INT(ss_flat_unpadded_numel(l), 33);
    CHECK_EQ_INT(ss_flat_flat_numel(l), 33);
    CHECK_EQ_INT(ss_flat_shard_numel(l), 11);
    CHECK_EQ_INT(ss_flat_padded_numel(l), 33);
    CHECK_EQ_INT(ss_flat_shard_range(l, 1, &s, &e, NULL), 0);
    CHECK_EQ_INT(s, 11);
    CHECK_EQ_INT(e, 22);
    CHECK_EQ_INT(ss_flat_shard_infos(l, 1, f, NULL), 0);
    check_info(&f[0], 1, 0, 4, 11, 14);
    check_info(&f[1], 1, 5, 5, 0, 4);
    check_info(&f[2], 0, 0, 0, 0, 0);
    check_info(&f[3], 0, 0, 0, 0, 0);
    CHECK_EQ_INT(ss_flat_shard_infos(l, 2, f, NULL), 0);
    check_info(&f[0], 0, 0, 0, 0, 0);
    check_info(&f[1], 0, 0, 0, 0, 0);
    check_info(&f[2], 1, 2, 5, 0, 4);
    check_info(&f[3], 1, 10, 1, 0, 0);
    ss_flat_layout_free(l);
}

static void test_layout_unaligned_and_tails(void)
{
    const int64_t a[] = {10, 7}, one[] = {1}, zeros[] = {0, 0};
    ss_flat_layout *l = make(2, a, 4, 0);
    ss_flat_info f[2];

    if (l != NULL) { /* 17 over 4 ranks: chunks of 5, last one 2 + 3 pad */
        CHECK_EQ_INT(ss_flat_nsegments(l), 2);
        CHECK_EQ_INT(ss_flat_flat_numel(l), 17);
        CHECK_EQ_INT(ss_flat_shard_numel(l), 5);
        CHECK_EQ_INT(ss_flat_padded_numel(l), 20);
        CHECK_EQ_INT(ss_flat_shard_infos(l, 3, f, NULL), 0);
        check_info(&f[0], 0, 0, 0, 0, 0);
        check_info(&f[1], 1, 0, 2, 5, 6);
        CHECK_EQ_INT(ss_flat_shard_infos(l, 1, f, NULL), 0);
        check_info(&f[0], 1, 0, 5, 5, 9);
        check_info(&f[1], 0, 0, 0, 0, 0);
        ss_flat_layout_free(l);
    }
    l = make(1, one, 4, 0); /* one element: ranks 1..3 hold only padding */
    if (l != NULL) {
        CHECK_EQ_INT(ss_flat_shard_numel(l), 1);
        for (int r = 1; r < 4; r++) {
            CHECK_EQ_INT(ss_flat_shard_infos(l, r, f, NULL), 0);
            CHECK_EQ_INT(f[0].in_shard, 0);
        }
        ss_flat_layout_free(l);
    }
    l = make(2, zeros, 3, 4); /* nothing at all: empty shards */
    if (l != NULL) {
        CHECK_EQ_INT(ss_flat_shard_numel(l), 0);
        CHECK_EQ_INT(ss_flat_padded_numel(l), 0);
        CHECK_EQ_INT(ss_flat_nsegments(l), 2);
        CHECK_EQ_INT(ss_flat_shard_infos(l, 2, f, NULL), 0);
        CHECK_EQ_INT(f[0].in_shard + f[1].in_shard, 0);
        ss_flat_layout_free(l);
    }
}

/* torch's formula puts a zero-numel parameter strictly inside a shard "in"
 * it, with numel 0 and intra_end -1; at a shard's start it is not. */
static void test_layout_zero_numel_params(void)
{
    const int64_t a[] = {3, 0, 1}, b[] = {2, 0, 2};
    ss_flat_layout *l = make(3, a, 2, 0);
    ss_flat_info f[3];

    if (l != NULL) {
        CHECK_EQ_INT(ss_flat_shard_infos(l, 1, f, NULL), 0);
        check_info(&f[0], 1, 0, 1, 2, 2);
        check_info(&f[1], 1, 1, 0, 0, -1);
        check_info(&f[2], 1, 1, 1, 0, 0);
        ss_flat_layout_free(l);
    }
    l = make(3, b, 2, 0);
    if (l != NULL) {
        for (int r = 0; r < 2; r++) {
            CHECK_EQ_INT(ss_flat_shard_infos(l, r, f, NULL), 0);
            CHECK_EQ_INT(f[1].in_shard, 0);
        }
        ss_flat_layout_free(l);
    }
}

/* Alignment rule on random numels, checked segment by segment, and the
 * infos against a walk over every element of the padded flat parameter. */
static void test_layout_random_against_walk(void)
{
    for (int iter = 0; iter < 400; iter++) {
        size_t n = (size_t)rnd_in(1, 7);
        int64_t numels[7], ws = rnd_in(1, 5);
        int64_t align = (int64_t[]){0, 0, 1, 2, 4, 8}[rnd_in(0, 5)];
        ss_flat_layout *l;
        int64_t total = 0;
        ss_flat_info f[7];

        for (size_t i = 0; i < n; i++)
            numels[i] = rnd_in(0, 3) == 0 ? rnd_in(0, 2) : rnd_in(0, 40);
        if ((l = make(n, numels, ws, align)) == NULL)
            return;
        for (size_t i = 0; i < n; i++) {
            if (align > 0 && total % align != 0)
                total += align - total % align;
            CHECK_EQ_INT(ss_flat_offsets(l)[i], total);
            total += numels[i];
        }
        CHECK_EQ_INT(ss_flat_unpadded_numel(l), total);
        if (align > 0 && total % ws != 0)
            total += ws - total % ws;
        CHECK_EQ_INT(ss_flat_flat_numel(l), total);
        CHECK_EQ_INT(ss_flat_shard_numel(l), (total + ws - 1) / ws);
        for (int64_t r = 0; r < ws; r++) {
            int64_t s, e;
            CHECK_EQ_INT(ss_flat_shard_range(l, r, &s, &e, NULL), 0);
            CHECK_EQ_INT(ss_flat_shard_infos(l, r, f, NULL), 0);
            for (size_t i = 0; i < n; i++) {
                int64_t ps = ss_flat_offsets(l)[i], lo = -1, hi = -1;
                for (int64_t x = s; x < e; x++)
                    if (x >= ps && x < ps + numels[i]) {
                        if (lo < 0)
                            lo = x;
                        hi = x;
                    }
                if (numels[i] == 0) {
                    CHECK_EQ_INT(f[i].in_shard, s < ps && ps < e);
                    continue;
                }
                CHECK_EQ_INT(f[i].in_shard, lo >= 0);
                if (lo < 0)
                    continue;
                check_info(&f[i], 1, lo - s, hi - lo + 1, lo - ps, hi - ps);
            }
        }
        ss_flat_layout_free(l);
    }
}

static void test_layout_errors(void)
{
    const int64_t ok[] = {4, 4}, neg[] = {4, -1};
    const int64_t big[] = {INT64_MAX - 2, 2}, huge[] = {INT64_MAX};
    ss_flat_layout *l = NULL;
    ss_flat_info f[2];
    ss_errinfo e;
    int64_t s, en;

    ss_errinfo_clear(&e);
    CHECK_EQ_INT(ss_flat_layout_new(&l, 0, ok, 2, 0, &e), SS_EINVAL);
    CHECK(l == NULL && strstr(e.detail, "at least one") != NULL);
    CHECK_EQ_INT(ss_flat_layout_new(&l, 2, ok, 0, 0, NULL), SS_EINVAL);
    CHECK_EQ_INT(ss_flat_layout_new(&l, 2, ok, 2, -1, NULL), SS_EINVAL);
    CHECK_EQ_INT(ss_flat_layout_new(&l, 2, neg, 2, 0, &e), SS_EINVAL);
    CHECK(strstr(e.detail, "parameter 1") != NULL);
    /* alignment padding after the first pushes the total past INT64_MAX */
    CHECK_EQ_INT(ss_flat_layout_new(&l, 2, big, 1, 8, NULL), SS_ERANGE);
    /* shard_numel * world_size overflows */
    CHECK_EQ_INT(ss_flat_layout_new(&l, 1, huge, 2, 0, NULL), SS_ERANGE);
    CHECK(l == NULL);
    l = make(2, ok, 3, 0);
    if (l == NULL)
        return;
    CHECK_EQ_INT(ss_flat_shard_range(l, 3, &s, &en, NULL), SS_EINVAL);
    CHECK_EQ_INT(ss_flat_shard_range(l, -1, &s, &en, NULL), SS_EINVAL);
    CHECK_EQ_INT(ss_flat_shard_infos(l, 5, f, NULL), SS_EINVAL);
    CHECK_EQ_INT(ss_flat_range_infos(l, 2, 1, f, NULL), SS_EINVAL);
    CHECK_EQ_INT(ss_flat_range_infos(l, -1, 3, f, NULL), SS_EINVAL);
    CHECK_EQ_INT(ss_flat_range_infos(l, 2, 1000, f, NULL), 0);
    check_info(&f[0], 1, 0, 2, 2, 3);
    check_info(&f[1], 1, 2, 4, 0, 3);
    ss_flat_layout_free(l);
    ss_flat_layout_free(NULL);
}

/* ---- copies ------------------------------------------------------------- */

/* The reference: the whole padded flat parameter, pad everywhere except
 * the parameters (zeros for a missing one), then rank's slice. */
static void reference_shard(const ss_flat_layout *l, int64_t rank, size_t is,
                            const ss_flat_piece *p, const unsigned char *pad,
                            unsigned char *out)
{
    int64_t total = ss_flat_padded_numel(l), sn = ss_flat_shard_numel(l);
    unsigned char *full = malloc((size_t)(total ? total : 1) * is);
    for (int64_t x = 0; x < total; x++)
        for (size_t b = 0; b < is; b++)
            full[(size_t)x * is + b] = pad ? pad[b] : 0;
    for (size_t i = 0; i < ss_flat_nparams(l); i++) {
        unsigned char *dst = full + (size_t)ss_flat_offsets(l)[i] * is;
        size_t nb = (size_t)ss_flat_numels(l)[i] * is;
        if (p[i].data == NULL)
            memset(dst, 0, nb);
        else
            memcpy(dst, p[i].data, nb);
    }
    memcpy(out, full + (size_t)(rank * sn) * is, (size_t)sn * is);
    free(full);
}

static void test_copy_random_many_jobs(void)
{
    ss_pool *pool = NULL;
    CHECK_EQ_INT(ss_pool_new(&pool, 3), 0);
    for (int iter = 0; iter < 120; iter++) {
        enum { MAXJ = 6, MAXP = 6 };
        ss_flat_job jobs[MAXJ];
        ss_flat_layout *ls[MAXJ];
        ss_flat_piece pieces[MAXJ][MAXP], back[MAXJ][MAXP];
        unsigned char *want[MAXJ];
        unsigned char pad[8];
        size_t nj = (size_t)rnd_in(1, MAXJ),
               is = (size_t[]){1, 2, 4, 8}[rnd_in(0, 3)];
        int big = iter % 10 == 0; /* some elements past a task's size */

        for (size_t b = 0; b < is; b++)
            pad[b] = (unsigned char)(0x40 + b);
        for (size_t j = 0; j < nj; j++) {
            size_t n = (size_t)rnd_in(1, MAXP);
            int64_t numels[MAXP], ws = rnd_in(1, 4);
            for (size_t i = 0; i < n; i++)
                numels[i] = big ? rnd_in(0, 150000) : rnd_in(0, 50);
            ls[j] = make(n, numels, ws, rnd_in(0, 1) ? 0 : (int64_t)(16 / is));
            for (size_t i = 0; i < n; i++) {
                size_t nb = (size_t)numels[i] * is;
                unsigned char *d = NULL;
                if (rnd_in(0, 5) != 0) {
                    d = malloc(nb ? nb : 1);
                    for (size_t b = 0; b < nb; b++)
                        d[b] = (unsigned char)rnd();
                }
                pieces[j][i] = (ss_flat_piece){d, 0, numels[i]};
            }
            jobs[j] = (ss_flat_job){
                ls[j],     rnd_in(0, ws - 1),
                is,        malloc((size_t)ss_flat_shard_numel(ls[j]) * is + 1),
                pieces[j], iter % 2 ? pad : NULL};
            want[j] = malloc((size_t)ss_flat_shard_numel(ls[j]) * is + 1);
            reference_shard(ls[j], jobs[j].rank, is, pieces[j],
                            iter % 2 ? pad : NULL, want[j]);
        }
        CHECK_EQ_INT(ss_flat_flatten(iter % 3 ? pool : NULL, jobs, nj, NULL),
                     0);
        for (size_t j = 0; j < nj; j++)
            CHECK(memcmp(jobs[j].shard, want[j],
                         (size_t)ss_flat_shard_numel(ls[j]) * is) == 0);
        /* unflatten into fresh zeroed buffers: exactly the shard's part of
         * each parameter arrives, nothing else is touched */
        for (size_t j = 0; j < nj; j++) {
            ss_flat_info f[MAXP];
            CHECK_EQ_INT(ss_flat_shard_infos(ls[j], jobs[j].rank, f, NULL), 0);
            for (size_t i = 0; i < ss_flat_nparams(ls[j]); i++) {
                size_t nb = (size_t)ss_flat_numels(ls[j])[i] * is;
                back[j][i] = (ss_flat_piece){calloc(1, nb ? nb : 1), 0,
                                             ss_flat_numels(ls[j])[i]};
            }
            jobs[j].pieces = back[j];
        }
        CHECK_EQ_INT(ss_flat_unflatten(iter % 3 ? pool : NULL, jobs, nj, NULL),
                     0);
        for (size_t j = 0; j < nj; j++) {
            ss_flat_info f[MAXP];
            ss_flat_shard_infos(ls[j], jobs[j].rank, f, NULL);
            for (size_t i = 0; i < ss_flat_nparams(ls[j]); i++) {
                const unsigned char *got = back[j][i].data;
                const unsigned char *src = pieces[j][i].data;
                for (int64_t x = 0; x < ss_flat_numels(ls[j])[i]; x++) {
                    int in = f[i].in_shard && x >= f[i].intra_start &&
                             x <= f[i].intra_end;
                    for (size_t b = 0; b < is; b++) {
                        unsigned char w =
                            in && src ? src[(size_t)x * is + b] : 0;
                        if (got[(size_t)x * is + b] != w) {
                            CHECK(got[(size_t)x * is + b] == w);
                            x = INT64_MAX - 1;
                            break;
                        }
                    }
                }
                free(back[j][i].data);
                free(pieces[j][i].data);
            }
            free(jobs[j].shard);
            free(want[j]);
            ss_flat_layout_free(ls[j]);
        }
    }
    ss_pool_free(pool);
}

/* A dim-0 shard of a parameter as the piece: flatten needs it to cover the
 * shard's part, unflatten fills only what it holds. */
static void test_copy_partial_pieces(void)
{
    const int64_t numels[] = {10, 6};
    ss_flat_layout *l = make(2, numels, 2, 0); /* shards of 8 */
    float p0[10], p1[6], shard[8], part[4];
    ss_flat_piece pc[2];
    ss_flat_job job;
    ss_errinfo e;

    if (l == NULL)
        return;
    for (int i = 0; i < 10; i++)
        p0[i] = (float)i;
    for (int i = 0; i < 6; i++)
        p1[i] = (float)(100 + i);
    /* rank 1 holds p0[8:10] and p1[0:6] */
    pc[0] = (ss_flat_piece){p0 + 6, 6, 4};
    pc[1] = (ss_flat_piece){p1, 0, 6};
    job = (ss_flat_job){l, 1, sizeof(float), shard, pc, NULL};
    CHECK_EQ_INT(ss_flat_flatten(NULL, &job, 1, NULL), 0);
    CHECK(shard[0] == 8.0f && shard[1] == 9.0f && shard[2] == 100.0f &&
          shard[7] == 105.0f);
    pc[0] = (ss_flat_piece){p0 + 9, 9, 1}; /* misses element 8 */
    ss_errinfo_clear(&e);
    CHECK_EQ_INT(ss_flat_flatten(NULL, &job, 1, &e), SS_ERANGE);
    CHECK_EQ_INT(e.job, 0);
    CHECK(strstr(e.detail, "parameter 0") != NULL);
    /* unflatten into p0[7:11): only element 8 and 9 are in the shard */
    memset(part, 0, sizeof part);
    pc[0] = (ss_flat_piece){part, 6, 4};
    pc[1] = (ss_flat_piece){NULL, 0, 6};
    CHECK_EQ_INT(ss_flat_unflatten(NULL, &job, 1, NULL), 0);
    CHECK(part[0] == 0.0f && part[1] == 0.0f && part[2] == 8.0f &&
          part[3] == 9.0f);
    ss_flat_layout_free(l);
}

static void test_copy_errors(void)
{
    const int64_t numels[] = {4, 4};
    ss_flat_layout *l = make(2, numels, 2, 0);
    int32_t a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8}, shard[8];
    ss_flat_piece pc[2] = {{a, 0, 4}, {b, 0, 4}};
    ss_flat_job jobs[2];
    ss_errinfo e;

    if (l == NULL)
        return;
    jobs[0] = (ss_flat_job){l, 0, 4, shard, pc, NULL};
    jobs[1] = (ss_flat_job){l, 1, 4, shard, pc, NULL}; /* same out */
    CHECK_EQ_INT(ss_flat_flatten(NULL, jobs, 2, NULL), SS_EOVERLAP);
    jobs[1].shard = shard + 4;
    CHECK_EQ_INT(ss_flat_flatten(NULL, jobs, 2, NULL), 0);
    CHECK(shard[0] == 1 && shard[4] == 5);
    jobs[0].shard = a; /* writing a from a */
    CHECK_EQ_INT(ss_flat_flatten(NULL, jobs, 1, NULL), SS_EOVERLAP);
    jobs[0].shard = shard;
    jobs[1].rank = 2;
    ss_errinfo_clear(&e);
    CHECK_EQ_INT(ss_flat_flatten(NULL, jobs, 2, &e), SS_EINVAL);
    CHECK_EQ_INT(e.job, 1);
    jobs[1].rank = 1;
    jobs[1].itemsize = 0;
    CHECK_EQ_INT(ss_flat_flatten(NULL, jobs, 2, NULL), SS_EINVAL);
    jobs[1].itemsize = 4;
    pc[1] = (ss_flat_piece){b, 1, 4}; /* past the parameter's end */
    CHECK_EQ_INT(ss_flat_flatten(NULL, jobs, 2, NULL), SS_ERANGE);
    pc[1] = (ss_flat_piece){b, -1, 1};
    CHECK_EQ_INT(ss_flat_unflatten(NULL, jobs, 2, NULL), SS_ERANGE);
    pc[1] = (ss_flat_piece){b, 0, 4};
    jobs[1].layout = NULL;
    CHECK_EQ_INT(ss_flat_flatten(NULL, jobs, 2, NULL), SS_EINVAL);
    CHECK_EQ_INT(ss_flat_flatten(NULL, NULL, 0, NULL), 0);
    CHECK_EQ_INT(ss_flat_flatten(NULL, NULL, 1, NULL), SS_EINVAL);
    ss_flat_layout_free(l);
}

int main(void)
{
    ss_t_rng = 0x2545F4914F6CDD1Dull;
    RUN(test_layout_aligned_torch_values);
    RUN(test_layout_unaligned_and_tails);
    RUN(test_layout_zero_numel_params);
    RUN(test_layout_random_against_walk);
    RUN(test_layout_errors);
    RUN(test_copy_random_many_jobs);
    RUN(test_copy_partial_pieces);
    RUN(test_copy_errors);
    return ss_test_report("flat");
}
