/* ss_recread.c - a load's record reads as one call (ss_io_read_recs).
 *
 * The table is validated whole first (nothing is read if any entry is
 * bad). Then:
 *   1. every RANGE item becomes one read job into its destination, plus,
 *      for a partial read whose whole record is verified, discard jobs for
 *      the bytes before and after it (read into ss_io's per-task scratch,
 *      checksummed only); all of them run as one ss_io_read batch and the
 *      CRCs are combined here;
 *   2. SCATTER items are read, in rounds of at most `scratch` bytes, into
 *      one scratch buffer (one ss_io_read batch a round, each job checked
 *      against its CRC), then their regions are copied out with
 *      ss_copy_nd: small ones one task each over the pool, large ones one
 *      at a time, each split over the pool.
 * Invariant: after validation every source region lies inside its
 * record's data and every destination region inside [dst, dst + dst_len),
 * so a bad table can fail but not write out of bounds. Thread safety: the
 * call uses only its own state and the buffers the table names.
 */
#include "ss_crc.h"
#include "ss_geom.h"
#include "ss_io.h"
#include "ss_recread.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Byte extent [lo, hi) of an element region at base (strides any sign);
 * 0 with lo == hi for an empty region, -1 on int64 overflow. */
static int extent(int64_t base, const int64_t *sizes, const int64_t *strides,
                  int ndim, uint64_t elsize, int64_t *lo, int64_t *hi)
{
    int64_t a = base, b = base, t;
    for (int d = 0; d < ndim; d++) {
        if (sizes[d] == 0) {
            *lo = *hi = base;
            return 0;
        }
    }
    for (int d = 0; d < ndim; d++) {
        if (__builtin_mul_overflow(sizes[d] - 1, strides[d], &t))
            return -1;
        if (t < 0 ? __builtin_add_overflow(a, t, &a)
                  : __builtin_add_overflow(b, t, &b))
            return -1;
    }
    if (elsize > (uint64_t)INT64_MAX ||
        __builtin_add_overflow(b, (int64_t)elsize, &b))
        return -1;
    *lo = a;
    *hi = b;
    return 0;
}

static int bad(ss_errinfo *err, size_t i, const char *what)
{
    ss_errinfo_set(err, SS_EINVAL, "validate", NULL, -1, "item %zu: %s", i,
                   what);
    err->job = (int64_t)i;
    return SS_EINVAL;
}

static int validate_rec(const ss_io_rec *r, size_t i, size_t npaths,
                        ss_errinfo *err)
{
    int64_t lo, hi;

    if (r->file >= npaths)
        return bad(err, i, "file index outside the path table");
    if (r->offset < 0 || r->len > (uint64_t)(INT64_MAX - r->offset))
        return bad(err, i, "record data offset < 0 or past 2^63");
    if (r->kind == SS_IO_REC_RANGE) {
        if (r->start > r->len || r->count > r->len - r->start)
            return bad(err, i, "range runs past the record data");
        if (r->count > r->dst_len || (r->count > 0 && r->dst == NULL))
            return bad(err, i, "range larger than its destination");
        return 0;
    }
    if (r->kind != SS_IO_REC_SCATTER)
        return bad(err, i, "unknown kind");
    if (r->dev)
        return bad(err, i, "a scatter destination must be host memory");
    if (r->ndim < 0 || r->ndim > SS_IO_REC_MAX_NDIM || r->elsize == 0 ||
        (r->ndim > 0 && (r->sizes == NULL || r->src_strides == NULL ||
                         r->dst_strides == NULL)))
        return bad(err, i, "region needs 0..64 dims and an element size");
    for (int d = 0; d < r->ndim; d++)
        if (r->sizes[d] < 0)
            return bad(err, i, "negative region size");
    if (extent(r->src_off, r->sizes, r->src_strides, r->ndim, r->elsize, &lo,
               &hi) < 0 ||
        (lo < hi && (lo < 0 || (uint64_t)hi > r->len)))
        return bad(err, i, "source region outside the record data");
    if (extent(0, r->sizes, r->dst_strides, r->ndim, r->elsize, &lo, &hi) < 0 ||
        (lo < hi && (lo < 0 || (uint64_t)hi > r->dst_len || r->dst == NULL)))
        return bad(err, i, "destination region outside its buffer");
    return 0;
}

/* Run one ss_io_read batch; a failing job's index becomes its item's. */
static int run_jobs(const ss_os *os, ss_pool *pool, const char *const *paths,
                    size_t npaths, const ss_io_rjob *jobs, size_t njobs,
                    const ss_io_opts *opts, uint32_t *jcrc, const size_t *item,
                    ss_errinfo *err)
{
    ss_errinfo e;
    int rc = ss_io_read(os, pool, paths, npaths, jobs, njobs, opts, jcrc, &e);
    if (rc < 0) {
        if (e.job >= 0 && (size_t)e.job < njobs)
            e.job = (int64_t)item[e.job];
        if (err != NULL)
            ss_errinfo_copy(err, &e);
    }
    return rc;
}

static int mismatch(ss_errinfo *err, const char *path, const ss_io_rec *r,
                    size_t i, uint32_t got)
{
    ss_errinfo_set(err, SS_ECHECKSUM, "verify", path, r->offset,
                   "expected crc32 0x%08x, read 0x%08x over %llu bytes",
                   (unsigned)r->crc, (unsigned)got, (unsigned long long)r->len);
    err->job = (int64_t)i;
    return SS_ECHECKSUM;
}

/* Phase 1: every RANGE item (and the rest of those verified whole). */
static int read_ranges(const ss_os *os, ss_pool *pool, const char *const *paths,
                       size_t npaths, const ss_io_rec *recs, size_t n,
                       const ss_io_opts *opts, uint32_t *crcs, ss_errinfo *err)
{
    ss_io_opts o = *opts;
    size_t njobs = 0, k = 0;
    ss_io_rjob *jobs = NULL;
    size_t *item = NULL;
    uint32_t *jcrc = NULL;
    /* per item: index of its range job, its prefix and suffix jobs, or -1 */
    int64_t (*at)[3] = NULL;
    int rc = 0;

    for (size_t i = 0; i < n; i++)
        if (recs[i].kind == SS_IO_REC_RANGE)
            njobs += 3;
    if (njobs == 0)
        return 0;
    jobs = calloc(njobs, sizeof *jobs);
    item = malloc(njobs * sizeof *item);
    jcrc = calloc(njobs, sizeof *jcrc);
    at = malloc(n * sizeof *at);
    if (jobs == NULL || item == NULL || jcrc == NULL || at == NULL) {
        rc = ss_errinfo_set(err, SS_ENOMEM, "malloc", NULL, -1, NULL);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        const ss_io_rec *r = &recs[i];
        int full = r->start == 0 && r->count == r->len, rest;
        at[i][0] = at[i][1] = at[i][2] = -1;
        if (r->kind != SS_IO_REC_RANGE)
            continue;
        /* in file order (prefix, range, suffix): small ones coalesce */
        rest = opts->verify && r->whole && !full;
        if (rest && r->start > 0) {
            at[i][1] = (int64_t)k;
            item[k] = i;
            jobs[k++] =
                (ss_io_rjob){NULL, r->start, r->file, r->offset, 0, 0, 0, 1};
        }
        if (r->count > 0) {
            at[i][0] = (int64_t)k;
            item[k] = i;
            jobs[k++] = (ss_io_rjob){r->dst,  r->count,
                                     r->file, r->offset + (int64_t)r->start,
                                     r->crc,  full && r->whole,
                                     r->dev,  0};
        }
        if (rest && r->start + r->count < r->len) {
            uint64_t end = r->start + r->count;
            at[i][2] = (int64_t)k;
            item[k] = i;
            jobs[k++] = (ss_io_rjob){
                NULL, r->len - end, r->file, r->offset + (int64_t)end, 0, 0, 0,
                1};
        }
    }
    o.checksum = opts->checksum || opts->verify;
    rc = run_jobs(os, pool, paths, npaths, jobs, k, &o, jcrc, item, err);
    for (size_t i = 0; rc == 0 && i < n; i++) {
        const ss_io_rec *r = &recs[i];
        uint32_t crc;
        if (r->kind != SS_IO_REC_RANGE)
            continue;
        crc = at[i][0] >= 0 ? jcrc[at[i][0]] : 0;
        if (crcs != NULL)
            crcs[i] = crc;
        if (at[i][1] < 0 && at[i][2] < 0)
            continue; /* whole (checked by ss_io_read) or not verified */
        if (at[i][1] >= 0)
            crc = ss_crc32_combine(jcrc[at[i][1]], crc, r->count);
        if (at[i][2] >= 0)
            crc = ss_crc32_combine(crc, jcrc[at[i][2]],
                                   r->len - r->start - r->count);
        if (crc != r->crc)
            rc = mismatch(err, paths[r->file], r, i, crc);
    }
out:
    free(jobs);
    free(item);
    free(jcrc);
    free(at);
    return rc;
}

typedef struct {
    const ss_io_rec *recs;
    const size_t *idx; /* the round's items to copy */
    const char *scratch;
    const uint64_t *pos; /* each one's data offset in scratch */
    ss_pool *pool;       /* for copies split over the pool, else NULL */
    atomic_int rc;       /* a failure (copy tasks never fail once valid) */
} copy_ctx;

static void copy_task(void *ctx, size_t t)
{
    copy_ctx *c = ctx;
    const ss_io_rec *r = &c->recs[c->idx[t]];
    ss_errinfo e;
    int rc = ss_copy_nd(c->pool, r->dst, r->dst_strides,
                        c->scratch + c->pos[t] + r->src_off, r->src_strides,
                        r->sizes, r->ndim, (size_t)r->elsize, &e);
    if (rc < 0) /* validated regions: not expected; any failure will do */
        atomic_store(&c->rc, rc);
}

/* Items [a, b) of the SCATTER ones (idx) as one round. */
static int scatter_round(const ss_os *os, ss_pool *pool,
                         const char *const *paths, size_t npaths,
                         const ss_io_rec *recs, const size_t *idx, size_t m,
                         const ss_io_opts *opts, uint32_t *crcs,
                         ss_errinfo *err)
{
    uint64_t total = 0;
    char *scratch = NULL;
    uint64_t *pos = malloc((m + 1) * sizeof *pos);
    ss_io_rjob *jobs = calloc(m + 1, sizeof *jobs);
    size_t *item = malloc((m + 1) * sizeof *item);
    uint32_t *jcrc = calloc(m + 1, sizeof *jcrc);
    size_t k = 0, nsmall = 0;
    size_t *small = malloc((m + 1) * sizeof *small);
    uint64_t *spos = malloc((m + 1) * sizeof *spos);
    int rc = 0;

    if (pos == NULL || jobs == NULL || item == NULL || jcrc == NULL ||
        small == NULL || spos == NULL) {
        rc = ss_errinfo_set(err, SS_ENOMEM, "malloc", NULL, -1, NULL);
        goto out;
    }
    for (size_t t = 0; t < m; t++) {
        pos[t] = total;
        total += recs[idx[t]].len;
    }
    scratch = malloc(total ? total : 1);
    if (scratch == NULL) {
        rc = ss_errinfo_set(err, SS_ENOMEM, "malloc", NULL, -1,
                            "%llu bytes of scratch", (unsigned long long)total);
        goto out;
    }
    for (size_t t = 0; t < m; t++) {
        const ss_io_rec *r = &recs[idx[t]];
        if (r->len == 0)
            continue;
        item[k] = idx[t];
        jobs[k++] = (ss_io_rjob){scratch + pos[t], r->len, r->file, r->offset,
                                 r->crc,           1,      0,       0};
    }
    rc = run_jobs(os, pool, paths, npaths, jobs, k, opts, jcrc, item, err);
    if (rc < 0)
        goto out;
    for (size_t t = 0, j = 0; crcs != NULL && t < m; t++)
        crcs[idx[t]] = recs[idx[t]].len ? jcrc[j++] : 0;
    {
        copy_ctx c = {recs, small, scratch, spos, NULL, 0};
        int copy_rc = 0;
        for (size_t t = 0; t < m; t++) {
            const ss_io_rec *r = &recs[idx[t]];
            if (r->len >= (uint64_t)SS_COPY_PARALLEL_MIN)
                continue;
            small[nsmall] = idx[t];
            spos[nsmall++] = pos[t];
        }
        ss_pool_run(pool, nsmall, copy_task, &c);
        copy_rc = atomic_load(&c.rc);
        for (size_t t = 0; copy_rc == 0 && t < m; t++) {
            const ss_io_rec *r = &recs[idx[t]];
            copy_ctx one = {recs, &idx[t], scratch, &pos[t], pool, 0};
            if (r->len < (uint64_t)SS_COPY_PARALLEL_MIN)
                continue;
            copy_task(&one, 0);
            copy_rc = atomic_load(&one.rc);
        }
        if (copy_rc < 0)
            rc = ss_errinfo_set(err, copy_rc, "copy", NULL, -1, NULL);
    }
out:
    free(scratch);
    free(pos);
    free(jobs);
    free(item);
    free(jcrc);
    free(small);
    free(spos);
    return rc;
}

int ss_io_read_recs(const ss_os *os, ss_pool *pool, const char *const *paths,
                    size_t npaths, const ss_io_rec *recs, size_t n,
                    const ss_io_opts *opts, uint64_t scratch, uint32_t *crcs,
                    ss_errinfo *err)
{
    const ss_io_opts defaults = SS_IO_OPTS_INIT;
    ss_errinfo e;
    size_t *idx = NULL, m = 0;
    int rc = 0;

    ss_errinfo_clear(&e);
    if (opts == NULL)
        opts = &defaults;
    if (crcs != NULL)
        memset(crcs, 0, n * sizeof *crcs);
    for (size_t i = 0; i < n; i++)
        if ((rc = validate_rec(&recs[i], i, npaths, &e)) < 0)
            goto out;
    if ((rc = read_ranges(os, pool, paths, npaths, recs, n, opts, crcs, &e)) <
        0)
        goto out;
    idx = malloc((n + 1) * sizeof *idx);
    if (idx == NULL) {
        rc = ss_errinfo_set(&e, SS_ENOMEM, "malloc", NULL, -1, NULL);
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        if (recs[i].kind == SS_IO_REC_SCATTER)
            idx[m++] = i;
    for (size_t a = 0; a < m;) {
        size_t b = a + 1;
        uint64_t used = recs[idx[a]].len;
        while (b < m && used <= scratch && recs[idx[b]].len <= scratch - used) {
            used += recs[idx[b]].len;
            b++;
        }
        rc = scatter_round(os, pool, paths, npaths, recs, idx + a, b - a, opts,
                           crcs, &e);
        if (rc < 0)
            goto out;
        a = b;
    }
out:
    free(idx);
    if (err != NULL)
        ss_errinfo_copy(err, &e);
    return rc;
}
