/* ss_flat.c - FSDP1 FlatParameter layout and batched flatten/unflatten.
 *
 * Layout invariants: one allocation holds numels/offsets (nparams) and the
 * segment table (nsegs <= 2 * nparams + 1: each parameter, at most one
 * alignment padding before it, and one world-size padding at the end);
 * offsets are increasing, offsets[i] + numels[i] <= unpadded_numel <=
 * flat_numel <= padded_numel = shard_numel * world_size, all checked
 * against int64 overflow when built. Nothing is written afterwards.
 *
 * Copies: every job is validated and turned into a list of operations
 * (copy src -> dst, or fill dst with an element pattern) in shard order,
 * destination ranges are checked for overlap (sorted, then each source is
 * searched among them), and the operations are cut into pool tasks of
 * about SS_FLAT_TASK_BYTES: large operations are split at element
 * boundaries, small consecutive ones grouped. Tasks write disjoint bytes
 * and cannot fail, so no lock is needed while they run.
 */
#include "ss_flat.h"

#include "ss_copy.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

struct ss_flat_layout {
    size_t nparams, nsegs;
    int64_t world_size, align_numel;
    int64_t unpadded_numel, flat_numel, shard_numel, padded_numel;
    int64_t *numels;           /* nparams */
    int64_t *offsets;          /* nparams */
    int64_t *seg_numels;       /* nsegs */
    unsigned char *seg_is_pad; /* nsegs */
};

/* ---- checked arithmetic (operands >= 0) --------------------------------- */

static int add_ok(int64_t a, int64_t b, int64_t *r)
{
    if (a > INT64_MAX - b)
        return 0;
    *r = a + b;
    return 1;
}

static int mul_ok(int64_t a, int64_t b, int64_t *r)
{
    if (a != 0 && b > INT64_MAX / a)
        return 0;
    *r = a * b;
    return 1;
}

/* n elements of itemsize bytes as a size_t byte count; 0 on overflow. */
static int bytes_ok(int64_t n, size_t itemsize, size_t *r)
{
    int64_t b;
    if (!mul_ok(n, (int64_t)itemsize, &b) || (uint64_t)b > (uint64_t)SIZE_MAX)
        return 0;
    *r = (size_t)b;
    return 1;
}

/* ---- layout ------------------------------------------------------------- */

int ss_flat_layout_new(ss_flat_layout **out, size_t nparams,
                       const int64_t *numels, int64_t world_size,
                       int64_t align_numel, ss_errinfo *err)
{
    static const char op[] = "flat_layout";
    ss_flat_layout *l = NULL;
    size_t maxsegs, nseg = 0, bytes;
    int64_t total = 0, pad;
    int rc = 0;

    *out = NULL;
    if (nparams == 0) {
        rc = ss_errinfo_set(err, SS_EINVAL, op, NULL, -1,
                            "a flat parameter needs at least one parameter");
        goto out;
    }
    if (numels == NULL || world_size < 1 || align_numel < 0) {
        rc = ss_errinfo_set(err, SS_EINVAL, op, NULL, -1,
                            "world_size %lld (need >= 1), align_numel %lld "
                            "(need >= 0)",
                            (long long)world_size, (long long)align_numel);
        goto out;
    }
    if (nparams > SIZE_MAX / 64) {
        rc = ss_errinfo_set(err, SS_ENOMEM, op, NULL, -1, NULL);
        goto out;
    }
    maxsegs = 2 * nparams + 1;
    bytes = sizeof *l + 2 * nparams * sizeof(int64_t) +
            maxsegs * (sizeof(int64_t) + 1);
    l = calloc(1, bytes);
    if (l == NULL) {
        rc = ss_errinfo_set(err, SS_ENOMEM, op, NULL, -1, NULL);
        goto out;
    }
    l->numels = (int64_t *)(l + 1);
    l->offsets = l->numels + nparams;
    l->seg_numels = l->offsets + nparams;
    l->seg_is_pad = (unsigned char *)(l->seg_numels + maxsegs);
    l->nparams = nparams;
    l->world_size = world_size;
    l->align_numel = align_numel;

    for (size_t i = 0; i < nparams; i++) {
        if (numels[i] < 0) {
            rc = ss_errinfo_set(err, SS_EINVAL, op, NULL, -1,
                                "parameter %zu has numel %lld", i,
                                (long long)numels[i]);
            goto out;
        }
        /* torch: numel_to_pad = aligned - total % aligned, inserted when in
         * (0, aligned); so never when total is already aligned. */
        if (align_numel > 0) {
            pad = align_numel - total % align_numel;
            if (pad > 0 && pad < align_numel) {
                if (!add_ok(total, pad, &total))
                    goto overflow;
                l->seg_numels[nseg] = pad;
                l->seg_is_pad[nseg++] = 1;
            }
        }
        l->numels[i] = numels[i];
        l->offsets[i] = total;
        if (!add_ok(total, numels[i], &total))
            goto overflow;
        l->seg_numels[nseg] = numels[i];
        l->seg_is_pad[nseg++] = 0;
    }
    l->unpadded_numel = total;
    if (align_numel > 0) { /* world-size divisibility, aligned mode only */
        pad = world_size - total % world_size;
        if (pad > 0 && pad < world_size) {
            if (!add_ok(total, pad, &total))
                goto overflow;
            l->seg_numels[nseg] = pad;
            l->seg_is_pad[nseg++] = 1;
        }
    }
    assert(nseg <= maxsegs);
    l->nsegs = nseg;
    l->flat_numel = total;
    /* torch.chunk: chunk size ceil(total / world_size); F.pad pads every
     * rank's chunk (possibly empty) to it. */
    l->shard_numel = total / world_size + (total % world_size != 0);
    if (!mul_ok(l->shard_numel, world_size, &l->padded_numel))
        goto overflow;
    *out = l;
    l = NULL;
    goto out;
overflow:
    rc = ss_errinfo_set(err, SS_ERANGE, op, NULL, -1,
                        "flat parameter size overflows int64");
out:
    free(l);
    return rc;
}

void ss_flat_layout_free(ss_flat_layout *l)
{
    free(l);
}

size_t ss_flat_nparams(const ss_flat_layout *l)
{
    return l->nparams;
}
int64_t ss_flat_world_size(const ss_flat_layout *l)
{
    return l->world_size;
}
int64_t ss_flat_align_numel(const ss_flat_layout *l)
{
    return l->align_numel;
}
const int64_t *ss_flat_numels(const ss_flat_layout *l)
{
    return l->numels;
}
const int64_t *ss_flat_offsets(const ss_flat_layout *l)
{
    return l->offsets;
}
int64_t ss_flat_unpadded_numel(const ss_flat_layout *l)
{
    return l->unpadded_numel;
}
int64_t ss_flat_flat_numel(const ss_flat_layout *l)
{
    return l->flat_numel;
}
int64_t ss_flat_shard_numel(const ss_flat_layout *l)
{
    return l->shard_numel;
}
int64_t ss_flat_padded_numel(const ss_flat_layout *l)
{
    return l->padded_numel;
}
size_t ss_flat_nsegments(const ss_flat_layout *l)
{
    return l->nsegs;
}
const int64_t *ss_flat_segment_numels(const ss_flat_layout *l)
{
    return l->seg_numels;
}
const unsigned char *ss_flat_segment_is_padding(const ss_flat_layout *l)
{
    return l->seg_is_pad;
}

int ss_flat_shard_range(const ss_flat_layout *l, int64_t rank, int64_t *start,
                        int64_t *end, ss_errinfo *err)
{
    if (rank < 0 || rank >= l->world_size)
        return ss_errinfo_set(err, SS_EINVAL, "shard_range", NULL, -1,
                              "rank %lld outside [0, %lld)", (long long)rank,
                              (long long)l->world_size);
    /* <= padded_numel, which did not overflow */
    *start = rank * l->shard_numel;
    *end = *start + l->shard_numel;
    return 0;
}

int ss_flat_range_infos(const ss_flat_layout *l, int64_t start, int64_t end,
                        ss_flat_info *out, ss_errinfo *err)
{
    if (start < 0 || start > end)
        return ss_errinfo_set(err, SS_EINVAL, "shard_infos", NULL, -1,
                              "bad range [%lld, %lld) (need 0 <= start <= "
                              "end)",
                              (long long)start, (long long)end);
    /* torch's _get_shard_metadata with inclusive ends: s..e is the shard,
     * ps..pe the parameter (pe = ps - 1 for a zero-numel one). */
    int64_t s = start, e = end - 1;
    for (size_t i = 0; i < l->nparams; i++) {
        int64_t ps = l->offsets[i], pe = ps + l->numels[i] - 1;
        ss_flat_info *f = &out[i];
        memset(f, 0, sizeof *f);
        if (!(s <= pe && e >= ps))
            continue;
        f->in_shard = 1;
        if (s <= ps) {
            f->intra_start = 0;
            f->offset_in_shard = ps - s;
        } else {
            f->intra_start = s - ps;
            f->offset_in_shard = 0;
        }
        f->intra_end = (pe < e ? pe : e) - ps;
        f->numel_in_shard = f->intra_end - f->intra_start + 1;
        assert(f->offset_in_shard >= 0 && f->offset_in_shard < end - start);
    }
    return 0;
}

int ss_flat_shard_infos(const ss_flat_layout *l, int64_t rank,
                        ss_flat_info *out, ss_errinfo *err)
{
    int64_t s = 0, e = 0;
    int rc = ss_flat_shard_range(l, rank, &s, &e, err);
    return rc < 0 ? rc : ss_flat_range_infos(l, s, e, out, err);
}

/* ---- copies ------------------------------------------------------------- */

typedef struct {
    char *dst;
    const char *src;     /* NULL: fill */
    const char *pattern; /* fill element, NULL: zeros */
    size_t nbytes, itemsize;
} flat_op;

typedef struct {
    flat_op *ops;
    size_t n, cap;
} op_vec;

static int push(op_vec *v, char *dst, const char *src, const char *pattern,
                size_t nbytes, size_t itemsize)
{
    if (nbytes == 0)
        return 0;
    if (v->n == v->cap) {
        size_t cap = v->cap ? 2 * v->cap : 64;
        flat_op *p;
        if (cap > SIZE_MAX / sizeof *p)
            return SS_ENOMEM;
        p = realloc(v->ops, cap * sizeof *p);
        if (p == NULL)
            return SS_ENOMEM;
        v->ops = p;
        v->cap = cap;
    }
    v->ops[v->n++] = (flat_op){dst, src, pattern, nbytes, itemsize};
    return 0;
}

/* Fill n bytes (a whole number of elements) with the element pattern. */
static void fill(char *dst, const char *pattern, size_t n, size_t itemsize)
{
    int uniform = 1;
    size_t done;

    if (pattern != NULL)
        for (size_t k = 1; k < itemsize && uniform; k++)
            uniform = pattern[k] == pattern[0];
    if (pattern == NULL || uniform) {
        memset(dst, pattern == NULL ? 0 : (unsigned char)pattern[0], n);
        return;
    }
    memcpy(dst, pattern, itemsize);
    for (done = itemsize; done < n;) { /* double the filled prefix */
        size_t k = done < n - done ? done : n - done;
        memcpy(dst + done, dst, k);
        done += k;
    }
}

/* Validate one job and append its operations. */
static int job_ops(const ss_flat_job *job, int unflatten, op_vec *v,
                   ss_flat_info *infos, ss_errinfo *err)
{
    const char *op = unflatten ? "unflatten" : "flatten";
    const ss_flat_layout *l = job->layout;
    size_t is = job->itemsize, nb, cursor = 0, shard_bytes;
    int rc;

    if (l == NULL || is == 0 || is > SS_FLAT_MAX_ITEMSIZE)
        return ss_errinfo_set(err, SS_EINVAL, op, NULL, -1,
                              "no layout, or itemsize %zu outside [1, %d]", is,
                              SS_FLAT_MAX_ITEMSIZE);
    if ((rc = ss_flat_shard_infos(l, job->rank, infos, err)) < 0)
        return rc;
    if (!bytes_ok(l->shard_numel, is, &shard_bytes))
        return ss_errinfo_set(err, SS_ERANGE, op, NULL, -1,
                              "shard of %lld elements of %zu bytes overflows",
                              (long long)l->shard_numel, is);
    if ((job->shard == NULL && shard_bytes > 0) || job->pieces == NULL)
        return ss_errinfo_set(err, SS_EINVAL, op, NULL, -1,
                              "NULL shard or pieces");
    for (size_t i = 0; i < l->nparams; i++) {
        const ss_flat_piece *p = &job->pieces[i];
        const ss_flat_info *f = &infos[i];
        int64_t lo, hi, plo, phi;
        size_t off;

        if (p->start < 0 || p->numel < 0 || p->start > l->numels[i] ||
            p->numel > l->numels[i] - p->start)
            return ss_errinfo_set(err, SS_ERANGE, op, NULL, -1,
                                  "parameter %zu: piece [%lld, +%lld) outside "
                                  "the parameter's %lld elements",
                                  i, (long long)p->start, (long long)p->numel,
                                  (long long)l->numels[i]);
        if (!bytes_ok(p->numel, is, &nb))
            return ss_errinfo_set(err, SS_ERANGE, op, NULL, -1,
                                  "parameter %zu: piece size overflows", i);
        if (unflatten && p->data == NULL)
            continue;
        if (!f->in_shard || f->numel_in_shard == 0)
            continue;
        /* the shard holds the parameter's [lo, hi) at offset_in_shard */
        lo = f->intra_start;
        hi = f->intra_end + 1;
        plo = p->start;
        phi = p->start + p->numel;
        if (!unflatten) {
            off = (size_t)f->offset_in_shard * is;
            assert(off >= cursor); /* parameters are in flat order */
            if ((rc = push(v, (char *)job->shard + cursor, NULL, job->pad,
                           off - cursor, is)) < 0)
                goto nomem;
            nb = (size_t)f->numel_in_shard * is;
            if (p->data == NULL) {
                rc = push(v, (char *)job->shard + off, NULL, NULL, nb, is);
            } else if (plo > lo || phi < hi) {
                return ss_errinfo_set(err, SS_ERANGE, op, NULL, -1,
                                      "parameter %zu: the shard needs its "
                                      "elements [%lld, %lld), the piece holds "
                                      "[%lld, %lld)",
                                      i, (long long)lo, (long long)hi,
                                      (long long)plo, (long long)phi);
            } else {
                rc = push(v, (char *)job->shard + off,
                          (const char *)p->data + (size_t)(lo - plo) * is, NULL,
                          nb, is);
            }
            if (rc < 0)
                goto nomem;
            cursor = off + nb;
        } else {
            int64_t a = lo > plo ? lo : plo, b = hi < phi ? hi : phi;
            if (a >= b)
                continue;
            off = (size_t)(f->offset_in_shard + (a - lo)) * is;
            if ((rc = push(v, (char *)p->data + (size_t)(a - plo) * is,
                           (const char *)job->shard + off, NULL,
                           (size_t)(b - a) * is, is)) < 0)
                goto nomem;
        }
    }
    if (!unflatten && (rc = push(v, (char *)job->shard + cursor, NULL, job->pad,
                                 shard_bytes - cursor, is)) < 0)
        goto nomem;
    return 0;
nomem:
    return ss_errinfo_set(err, SS_ENOMEM, op, NULL, -1, NULL);
}

typedef struct {
    uintptr_t lo, hi;
} span;

static int span_cmp(const void *a, const void *b)
{
    uintptr_t x = ((const span *)a)->lo, y = ((const span *)b)->lo;
    return x < y ? -1 : x > y;
}

/* SS_EOVERLAP when two destinations, or a destination and a source,
 * share a byte. */
static int check_overlap(const op_vec *v, const char *op, ss_errinfo *err)
{
    span *d = NULL;
    int rc = 0;

    if (v->n == 0)
        return 0;
    d = malloc(v->n * sizeof *d);
    if (d == NULL)
        return ss_errinfo_set(err, SS_ENOMEM, op, NULL, -1, NULL);
    for (size_t i = 0; i < v->n; i++)
        d[i] = (span){(uintptr_t)v->ops[i].dst,
                      (uintptr_t)v->ops[i].dst + v->ops[i].nbytes};
    qsort(d, v->n, sizeof *d, span_cmp);
    for (size_t i = 1; i < v->n; i++)
        if (d[i].lo < d[i - 1].hi) {
            rc = ss_errinfo_set(err, SS_EOVERLAP, op, NULL, -1,
                                "two destination ranges overlap (a buffer "
                                "given twice?)");
            goto out;
        }
    for (size_t i = 0; i < v->n; i++) {
        uintptr_t lo, hi;
        size_t a = 0, b = v->n;
        if (v->ops[i].src == NULL)
            continue;
        lo = (uintptr_t)v->ops[i].src;
        hi = lo + v->ops[i].nbytes;
        while (a < b) { /* first destination ending after lo */
            size_t m = a + (b - a) / 2;
            if (d[m].hi <= lo)
                a = m + 1;
            else
                b = m;
        }
        if (a < v->n && d[a].lo < hi) {
            rc = ss_errinfo_set(err, SS_EOVERLAP, op, NULL, -1,
                                "a source range overlaps a destination");
            goto out;
        }
    }
out:
    free(d);
    return rc;
}

typedef struct {
    const flat_op *ops;
    const size_t *task_start; /* ntasks + 1 */
} run_ctx;

static void run_task(void *vctx, size_t t)
{
    const run_ctx *c = vctx;
    for (size_t k = c->task_start[t]; k < c->task_start[t + 1]; k++) {
        const flat_op *o = &c->ops[k];
        if (o->src != NULL)
            ss_copy(o->dst, o->src, o->nbytes);
        else
            fill(o->dst, o->pattern, o->nbytes, o->itemsize);
    }
}

/* Split ops over SS_FLAT_TASK_BYTES at element boundaries, group small
 * consecutive ones, and run the tasks. */
static int run_ops(ss_pool *pool, const op_vec *v, const char *op,
                   ss_errinfo *err)
{
    op_vec split = {0};
    size_t *starts = NULL, ntasks = 0, acc = 0;
    int rc = 0;

    for (size_t i = 0; i < v->n; i++) {
        const flat_op *o = &v->ops[i];
        size_t step = SS_FLAT_TASK_BYTES - SS_FLAT_TASK_BYTES % o->itemsize;
        for (size_t at = 0; at < o->nbytes; at += step) {
            size_t n = o->nbytes - at < step ? o->nbytes - at : step;
            if (push(&split, o->dst + at, o->src ? o->src + at : NULL,
                     o->pattern, n, o->itemsize) < 0)
                goto nomem;
        }
    }
    starts = malloc((split.n + 1) * sizeof *starts);
    if (starts == NULL)
        goto nomem;
    for (size_t k = 0; k < split.n; k++) {
        if (acc == 0)
            starts[ntasks++] = k;
        acc += split.ops[k].nbytes;
        if (acc >= SS_FLAT_TASK_BYTES)
            acc = 0;
    }
    starts[ntasks] = split.n;
    if (ntasks > 0) {
        run_ctx ctx = {split.ops, starts};
        ss_pool_run(ntasks > 1 ? pool : NULL, ntasks, run_task, &ctx);
    }
    goto out;
nomem:
    rc = ss_errinfo_set(err, SS_ENOMEM, op, NULL, -1, NULL);
out:
    free(starts);
    free(split.ops);
    return rc;
}

static int flat_copy(ss_pool *pool, const ss_flat_job *jobs, size_t njobs,
                     int unflatten, ss_errinfo *err)
{
    const char *op = unflatten ? "unflatten" : "flatten";
    op_vec v = {0};
    ss_flat_info *infos = NULL;
    size_t maxp = 0;
    int rc = 0;

    if (jobs == NULL && njobs > 0)
        return ss_errinfo_set(err, SS_EINVAL, op, NULL, -1, "NULL jobs");
    for (size_t j = 0; j < njobs; j++)
        if (jobs[j].layout != NULL && jobs[j].layout->nparams > maxp)
            maxp = jobs[j].layout->nparams;
    if (maxp > 0 && (infos = malloc(maxp * sizeof *infos)) == NULL) {
        rc = ss_errinfo_set(err, SS_ENOMEM, op, NULL, -1, NULL);
        goto out;
    }
    for (size_t j = 0; j < njobs; j++) {
        if ((rc = job_ops(&jobs[j], unflatten, &v, infos, err)) < 0) {
            if (err != NULL)
                err->job = (int64_t)j;
            goto out;
        }
    }
    if ((rc = check_overlap(&v, op, err)) < 0)
        goto out;
    rc = run_ops(pool, &v, op, err);
out:
    free(infos);
    free(v.ops);
    return rc;
}

int ss_flat_flatten(ss_pool *pool, const ss_flat_job *jobs, size_t njobs,
                    ss_errinfo *err)
{
    return flat_copy(pool, jobs, njobs, 0, err);
}

int ss_flat_unflatten(ss_pool *pool, const ss_flat_job *jobs, size_t njobs,
                      ss_errinfo *err)
{
    return flat_copy(pool, jobs, njobs, 1, err);
}
