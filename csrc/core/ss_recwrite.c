/* ss_recwrite.c - records to ss_io_write jobs, packed runs, trailer patches.
 *
 * The table is turned into jobs in its own order: a packed run becomes one
 * job at its first record, a big record two (header from the plan, data
 * from the caller), a plain item one. Runs are built by pool tasks, each
 * writing only its own run buffer and its records' crcs slots. The
 * trailers of big records live in one arena, copied from the plans'
 * templates and patched once the data batch has returned the CRCs.
 */
#include "ss_recwrite.h"
#include "ss_crc.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    size_t first, count; /* its records */
    size_t job;          /* its job in the data batch */
    uint64_t size;
    uint8_t *buf;
} run;

typedef struct {
    const ss_io_record *recs;
    run *runs;
    uint32_t *crcs; /* per record */
    atomic_int nomem;
} pack_ctx;

/* Whether record k is laid out in memory with its neighbours. */
static int packable(const ss_io_record *r)
{
    return r->plan != NULL && !(r->dev && r->len > 0) &&
           r->len <= SS_IO_PACK_RECORD;
}

static void pack_task(void *ctx, size_t i)
{
    pack_ctx *c = ctx;
    run *r = &c->runs[i];
    uint8_t *p = r->buf = malloc(r->size ? (size_t)r->size : 1);

    if (p == NULL) {
        atomic_store(&c->nomem, 1);
        return;
    }
    for (size_t k = r->first; k < r->first + r->count; k++) {
        const ss_io_record *rec = &c->recs[k];
        size_t hl, tl;
        const uint8_t *h = ss_zip_plan_header(rec->plan, &hl);
        const uint8_t *t = ss_zip_plan_trailer(rec->plan, &tl);
        uint32_t crc = 0;
        memcpy(p, h, hl);
        p += hl;
        if (rec->len > 0) { /* the CRC of the bytes written: the copy's */
            memcpy(p, rec->src, (size_t)rec->len);
            crc = ss_crc32(0, p, (size_t)rec->len);
            p += rec->len;
        }
        memcpy(p, t, tl);
        ss_zip_plan_patch(rec->plan, p, crc);
        p += tl;
        c->crcs[k] = crc;
    }
}

static int bad(ss_errinfo *err, size_t k, int64_t off, const char *what)
{
    ss_errinfo_set(err, SS_EINVAL, "validate", NULL, off, "record %zu: %s", k,
                   what);
    if (err != NULL)
        err->job = (int64_t)k;
    return SS_EINVAL;
}

static int validate(const ss_io_record *recs, size_t nrecs, size_t npaths,
                    const ss_io_opts *opts, ss_errinfo *err)
{
    for (size_t k = 0; k < nrecs; k++) {
        const ss_io_record *r = &recs[k];
        uint64_t total = r->len;
        if (r->file >= npaths)
            return bad(err, k, r->offset, "file index out of range");
        if (r->offset < 0)
            return bad(err, k, r->offset, "negative offset");
        if (r->len > 0 && r->src == NULL)
            return bad(err, k, r->offset, "no buffer");
        if (r->dev && r->len > 0 && opts->stage == NULL)
            return bad(err, k, r->offset,
                       "a device item needs a staging pipeline (opts.stage)");
        if (r->plan != NULL) {
            if (r->len != ss_zip_plan_data_length(r->plan))
                return bad(err, k, r->offset,
                           "data length is not its plan's storage size");
            total = ss_zip_plan_total_length(r->plan);
        }
        if (total > (uint64_t)(INT64_MAX - r->offset))
            return bad(err, k, r->offset, "offset + length past 2^63");
    }
    return 0;
}

int ss_io_write_records(const ss_os *os, ss_pool *pool,
                        const char *const *paths, size_t npaths,
                        const ss_io_record *recs, size_t nrecs,
                        const ss_io_opts *opts, uint64_t pack_run,
                        uint32_t *crcs, ss_errinfo *err)
{
    const ss_io_opts defaults = SS_IO_OPTS_INIT;
    ss_io_opts o;
    pack_ctx pc = {recs, NULL, NULL, 0};
    ss_io_wjob *jobs = NULL, *tjobs = NULL;
    size_t *data_job = NULL, nruns = 0, njobs = 0, ntrail = 0;
    uint32_t *jcrcs = NULL;
    uint8_t *arena = NULL;
    size_t arena_len = 0;
    int rc = 0;

    if (err != NULL)
        ss_errinfo_clear(err);
    if (opts == NULL)
        opts = &defaults;
    if (opts->size < sizeof *opts || opts->patch) {
        rc = ss_errinfo_set(err, SS_EINVAL, "options", NULL, -1,
                            "ss_io_opts.size is %zu (expected %zu), patch %d "
                            "(expected 0)",
                            opts->size, sizeof *opts, opts->patch);
        goto out;
    }
    if (pack_run == 0)
        pack_run = SS_IO_PACK_RUN;
    if ((rc = validate(recs, nrecs, npaths, opts, err)) < 0)
        goto out;
    pc.runs = malloc((nrecs ? nrecs : 1) * sizeof *pc.runs);
    pc.crcs =
        crcs != NULL ? crcs : malloc((nrecs ? nrecs : 1) * sizeof(uint32_t));
    jobs = malloc((2 * nrecs + 1) * sizeof *jobs);
    jcrcs = malloc((2 * nrecs + 1) * sizeof *jcrcs);
    data_job = malloc((nrecs ? nrecs : 1) * sizeof *data_job);
    if (pc.runs == NULL || pc.crcs == NULL || jobs == NULL || jcrcs == NULL ||
        data_job == NULL)
        goto nomem;

    /* runs, trailers and jobs, in table order */
    for (size_t k = 0; k < nrecs; k++) {
        const ss_io_record *r = &recs[k];
        data_job[k] = SIZE_MAX;
        pc.crcs[k] = 0;
        if (packable(r)) {
            uint64_t total = ss_zip_plan_total_length(r->plan);
            run *cur = nruns ? &pc.runs[nruns - 1] : NULL;
            const ss_io_record *last =
                cur != NULL ? &recs[cur->first + cur->count - 1] : NULL;
            if (cur != NULL && last == r - 1 && last->file == r->file &&
                (uint64_t)last->offset + ss_zip_plan_total_length(last->plan) ==
                    (uint64_t)r->offset &&
                cur->size <= pack_run) {
                cur->count++;
                cur->size += total;
                continue;
            }
            pc.runs[nruns++] = (run){k, 1, njobs, total, NULL};
            jobs[njobs++] = (ss_io_wjob){NULL, 0, r->file, r->offset, 0};
            continue;
        }
        if (r->plan == NULL) {
            data_job[k] = njobs;
            jobs[njobs++] =
                (ss_io_wjob){r->src, r->len, r->file, r->offset, r->dev};
            continue;
        }
        size_t hl, tl;
        const uint8_t *h = ss_zip_plan_header(r->plan, &hl);
        (void)ss_zip_plan_trailer(r->plan, &tl);
        jobs[njobs++] = (ss_io_wjob){h, hl, r->file, r->offset, 0};
        data_job[k] = njobs;
        jobs[njobs++] = (ss_io_wjob){r->src, r->len, r->file,
                                     r->offset + (int64_t)hl, r->dev};
        ntrail++;
        arena_len += tl;
    }
    if (ss_pool_run(pool, nruns, pack_task, &pc) < 0 || atomic_load(&pc.nomem))
        goto nomem;
    for (size_t i = 0; i < nruns; i++) {
        jobs[pc.runs[i].job].src = pc.runs[i].buf;
        jobs[pc.runs[i].job].len = pc.runs[i].size;
    }

    /* the data: everything but the big records' trailers */
    o = *opts;
    o.fsync = 0;
    o.checksum = 1;
    rc = ss_io_write(os, pool, paths, npaths, jobs, njobs, &o, jcrcs, err);
    if (rc < 0)
        goto out;

    /* the trailers, patched for their data's CRCs */
    tjobs = malloc((ntrail ? ntrail : 1) * sizeof *tjobs);
    arena = malloc(arena_len ? arena_len : 1);
    if (tjobs == NULL || arena == NULL)
        goto nomem;
    ntrail = 0;
    for (size_t k = 0, at = 0; k < nrecs; k++) {
        const ss_io_record *r = &recs[k];
        if (data_job[k] == SIZE_MAX)
            continue;
        uint32_t crc = jcrcs[data_job[k]];
        if (r->plan == NULL) {
            pc.crcs[k] = opts->checksum ? crc : 0;
            continue;
        }
        size_t hl, tl;
        (void)ss_zip_plan_header(r->plan, &hl);
        const uint8_t *t = ss_zip_plan_trailer(r->plan, &tl);
        pc.crcs[k] = crc;
        memcpy(arena + at, t, tl);
        ss_zip_plan_patch(r->plan, arena + at, crc);
        tjobs[ntrail++] = (ss_io_wjob){arena + at, tl, r->file,
                                       r->offset + (int64_t)(hl + r->len), 0};
        at += tl;
    }
    if (ntrail > 0 || opts->fsync) {
        o = *opts;
        o.patch = 1;
        o.checksum = 0;
        o.stage = NULL;
        rc = ss_io_write(os, pool, paths, npaths, tjobs, ntrail, &o, NULL, err);
    }
    goto out;

nomem:
    rc = ss_errinfo_set(err, SS_ENOMEM, "malloc", NULL, -1, NULL);
out:
    for (size_t i = 0; pc.runs != NULL && i < nruns; i++)
        free(pc.runs[i].buf);
    free(pc.runs);
    if (pc.crcs != crcs)
        free(pc.crcs);
    free(jobs);
    free(jcrcs);
    free(data_job);
    free(tjobs);
    free(arena);
    return rc;
}
