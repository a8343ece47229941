/* ss_geom.c - the box index (a bounding-box tree) and the N-d strided copy.
 *
 * Index invariants: the non-empty boxes are stored in tree order in lo/hi
 * (nlive x ndim, hi = offset + size) with their original indices in id;
 * node k covers the rows [start, start + count) and its bounding box
 * (nlo/nhi row k) is the union of theirs; an inner node's two children
 * split its rows at the middle, so the depth is at most ceil(log2(n)) and
 * a query's explicit stack never exceeds SS__STACK entries. Nothing is
 * written after ss_geom_index_new returns.
 *
 * Copy: the region is normalised (size-1 dims dropped, dims negative in
 * both buffers flipped, dims sorted by dst stride, dims contiguous in both
 * merged) and then walked as rows of the innermost dim, addressed by
 * int64 byte offsets so no pointer outside the regions is ever formed.
 * When src is contiguous along another dim than dst (a transpose), that
 * dim and the innermost are walked in tiles instead. Pool tasks take
 * disjoint ranges of the row-major element order (or of the tiles), so
 * they never write the same byte.
 */
#include "ss_geom.h"

#include "ss_copy.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

/* Boxes per leaf: small enough to keep false hits few, big enough that
 * node overhead stays below the box tests. */
#define SS__LEAF 8
#define SS__STACK 160

typedef struct {
    size_t start, count;
    int64_t left, right; /* child node indices; -1 in a leaf */
} geom_node;

struct ss_geom_index {
    int ndim;
    size_t n;     /* boxes given */
    size_t nlive; /* non-empty boxes, all in the tree (all n when ndim 0) */
    int64_t *lo, *hi;
    int64_t *id;     /* nlive: original index of each tree row */
    int64_t *row_of; /* n: tree row of each original box, -1 if empty */
    geom_node *nodes;
    size_t nnodes, cap_nodes;
    int64_t *nlo, *nhi; /* cap_nodes x ndim */
};

/* ---- validation --------------------------------------------------------- */

/* 1 when the box is valid; fills err otherwise. */
static int box_ok(int ndim, const int64_t *off, const int64_t *size,
                  ss_errinfo *err, const char *op, int64_t which)
{
    for (int d = 0; d < ndim; d++) {
        if (off[d] < 0 || size[d] < 0 || off[d] > INT64_MAX - size[d]) {
            ss_errinfo_set(err, SS_EINVAL, op, NULL, -1,
                           "box %lld dim %d: offset %lld size %lld (need "
                           "offset >= 0, size >= 0, offset + size <= "
                           "INT64_MAX)",
                           (long long)which, d, (long long)off[d],
                           (long long)size[d]);
            return 0;
        }
    }
    return 1;
}

static int box_empty(int ndim, const int64_t *size)
{
    for (int d = 0; d < ndim; d++)
        if (size[d] == 0)
            return 1;
    return 0;
}

/* ---- build -------------------------------------------------------------- */

typedef struct {
    ss_geom_index *ix;
    size_t *perm; /* rows of ix->lo/hi, reordered by the build */
    int64_t *key; /* scratch: the split key of perm[i] */
} builder;

static void swap_pk(size_t *perm, int64_t *key, size_t a, size_t b)
{
    size_t p = perm[a];
    int64_t k = key[a];
    perm[a] = perm[b];
    key[a] = key[b];
    perm[b] = p;
    key[b] = k;
}

static int64_t median3(int64_t a, int64_t b, int64_t c)
{
    if (a > b) {
        int64_t t = a;
        a = b;
        b = t;
    }
    return c < a ? a : (c > b ? b : c);
}

/* Reorder [lo, hi) so that position nth holds the key it would hold if
 * sorted, smaller-or-equal keys before it and greater-or-equal after.
 * Three-way partitions, so runs of equal keys (common in grids) stay
 * linear. Pivots are the median of three pseudo-random positions (a fixed
 * sequence, so builds are deterministic): fixed positions degrade to
 * quadratic on the rotated runs a partition of sorted input leaves. */
static void select_nth(size_t *perm, int64_t *key, size_t lo, size_t hi,
                       size_t nth)
{
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    while (hi - lo > 1) {
        size_t pos[3];
        for (int k = 0; k < 3; k++) { /* xorshift64 */
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            pos[k] = lo + (size_t)(rng % (uint64_t)(hi - lo));
        }
        int64_t p = median3(key[pos[0]], key[pos[1]], key[pos[2]]);
        size_t lt = lo, i = lo, gt = hi;
        while (i < gt) {
            if (key[i] < p)
                swap_pk(perm, key, lt++, i++);
            else if (key[i] > p)
                swap_pk(perm, key, i, --gt);
            else
                i++;
        }
        if (nth < lt)
            hi = lt;
        else if (nth >= gt)
            lo = gt;
        else
            return;
    }
}

static int add_node(ss_geom_index *ix, size_t start, size_t count, int64_t *out)
{
    int nd = ix->ndim;
    if (ix->nnodes == ix->cap_nodes) {
        size_t cap = ix->cap_nodes ? ix->cap_nodes * 2 : 16;
        geom_node *nodes = realloc(ix->nodes, cap * sizeof *nodes);
        if (nodes == NULL)
            return SS_ENOMEM;
        ix->nodes = nodes;
        int64_t *nlo = realloc(ix->nlo, cap * (size_t)nd * sizeof *nlo);
        if (nlo == NULL)
            return SS_ENOMEM;
        ix->nlo = nlo;
        int64_t *nhi = realloc(ix->nhi, cap * (size_t)nd * sizeof *nhi);
        if (nhi == NULL)
            return SS_ENOMEM;
        ix->nhi = nhi;
        ix->cap_nodes = cap;
    }
    *out = (int64_t)ix->nnodes;
    ix->nodes[ix->nnodes] = (geom_node){start, count, -1, -1};
    ix->nnodes++;
    return 0;
}

/* Build the subtree over perm[start, start + count) (count >= 1); its
 * node index goes to *out. Recursion depth is the tree depth. */
static int build(builder *b, size_t start, size_t count, int64_t *out)
{
    ss_geom_index *ix = b->ix;
    int nd = ix->ndim, rc, best = 0;
    int64_t self, left, right, best_spread = -1;
    size_t mid;

    rc = add_node(ix, start, count, &self);
    if (rc < 0)
        goto out;
    *out = self;
    if (count <= SS__LEAF) {
        int64_t *nlo = ix->nlo + self * nd, *nhi = ix->nhi + self * nd;
        for (int d = 0; d < nd; d++) {
            nlo[d] = INT64_MAX;
            nhi[d] = INT64_MIN;
        }
        for (size_t i = start; i < start + count; i++) {
            const int64_t *lo = ix->lo + b->perm[i] * (size_t)nd;
            const int64_t *hi = ix->hi + b->perm[i] * (size_t)nd;
            for (int d = 0; d < nd; d++) {
                if (lo[d] < nlo[d])
                    nlo[d] = lo[d];
                if (hi[d] > nhi[d])
                    nhi[d] = hi[d];
            }
        }
        goto out;
    }
    /* Split on the dimension whose box centres spread widest. */
    for (int d = 0; d < nd; d++) {
        int64_t cmin = INT64_MAX, cmax = INT64_MIN;
        for (size_t i = start; i < start + count; i++) {
            size_t r = b->perm[i] * (size_t)nd + (size_t)d;
            int64_t c = ix->lo[r] + (ix->hi[r] - ix->lo[r]) / 2;
            if (c < cmin)
                cmin = c;
            if (c > cmax)
                cmax = c;
        }
        if (cmax - cmin > best_spread) {
            best_spread = cmax - cmin;
            best = d;
        }
    }
    for (size_t i = start; i < start + count; i++) {
        size_t r = b->perm[i] * (size_t)nd + (size_t)best;
        b->key[i] = ix->lo[r] + (ix->hi[r] - ix->lo[r]) / 2;
    }
    mid = start + count / 2;
    select_nth(b->perm, b->key, start, start + count, mid);
    rc = build(b, start, mid - start, &left);
    if (rc < 0)
        goto out;
    rc = build(b, mid, start + count - mid, &right);
    if (rc < 0)
        goto out;
    /* ix->nodes may have moved; index it afresh. */
    ix->nodes[self].left = left;
    ix->nodes[self].right = right;
    for (int d = 0; d < nd; d++) {
        int64_t l0 = ix->nlo[left * nd + d], l1 = ix->nlo[right * nd + d];
        int64_t h0 = ix->nhi[left * nd + d], h1 = ix->nhi[right * nd + d];
        ix->nlo[self * nd + d] = l0 < l1 ? l0 : l1;
        ix->nhi[self * nd + d] = h0 > h1 ? h0 : h1;
    }
out:
    return rc;
}

/* Put lo/hi/id into the tree order given by perm. */
static int gather(ss_geom_index *ix, const size_t *perm)
{
    size_t nd = (size_t)ix->ndim, n = ix->nlive;
    int rc = 0;
    int64_t *lo = malloc(n * nd * sizeof *lo);
    int64_t *hi = malloc(n * nd * sizeof *hi);
    int64_t *id = malloc(n * sizeof *id);

    if (lo == NULL || hi == NULL || id == NULL) {
        rc = SS_ENOMEM;
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        memcpy(lo + i * nd, ix->lo + perm[i] * nd, nd * sizeof *lo);
        memcpy(hi + i * nd, ix->hi + perm[i] * nd, nd * sizeof *hi);
        id[i] = ix->id[perm[i]];
    }
    free(ix->lo);
    free(ix->hi);
    free(ix->id);
    ix->lo = lo;
    ix->hi = hi;
    ix->id = id;
    lo = hi = id = NULL;
out:
    free(lo);
    free(hi);
    free(id);
    return rc;
}

int ss_geom_index_new(ss_geom_index **out, int ndim, size_t n,
                      const int64_t *offsets, const int64_t *sizes,
                      ss_errinfo *err)
{
    int rc = 0;
    ss_geom_index *ix = NULL;
    builder b = {NULL, NULL, NULL};
    size_t nd = (size_t)ndim, live = 0;

    *out = NULL;
    if (ndim < 0 || ndim > SS_GEOM_MAX_NDIM) {
        rc = ss_errinfo_set(err, SS_EINVAL, "geom_index", NULL, -1,
                            "ndim %d outside [0, %d]", ndim, SS_GEOM_MAX_NDIM);
        goto out;
    }
    if (n > 0 && nd > 0 && (offsets == NULL || sizes == NULL)) {
        rc = ss_errinfo_set(err, SS_EINVAL, "geom_index", NULL, -1,
                            "NULL box arrays");
        goto out;
    }
    if (n > (SIZE_MAX / 4) / (nd ? nd : 1) / sizeof(int64_t)) {
        rc = SS_ENOMEM;
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        if (!box_ok(ndim, offsets + i * nd, sizes + i * nd, err, "geom_index",
                    (int64_t)i)) {
            rc = SS_EINVAL;
            goto out;
        }
    }
    ix = calloc(1, sizeof *ix);
    if (ix == NULL) {
        rc = SS_ENOMEM;
        goto out;
    }
    ix->ndim = ndim;
    ix->n = n;
    /* +1: never ask malloc for 0 bytes. */
    ix->lo = malloc((n * nd + 1) * sizeof *ix->lo);
    ix->hi = malloc((n * nd + 1) * sizeof *ix->hi);
    ix->id = malloc((n + 1) * sizeof *ix->id);
    if (ix->lo == NULL || ix->hi == NULL || ix->id == NULL) {
        rc = SS_ENOMEM;
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        const int64_t *o = offsets + i * nd, *s = sizes + i * nd;
        if (box_empty(ndim, s))
            continue; /* never overlaps anything (ndim 0 is never empty) */
        for (size_t d = 0; d < nd; d++) {
            ix->lo[live * nd + d] = o[d];
            ix->hi[live * nd + d] = o[d] + s[d];
        }
        ix->id[live++] = (int64_t)i;
    }
    ix->nlive = live;
    if (ndim > 0 && live > 0) {
        int64_t root;
        b.ix = ix;
        b.perm = malloc(live * sizeof *b.perm);
        b.key = malloc(live * sizeof *b.key);
        if (b.perm == NULL || b.key == NULL) {
            rc = SS_ENOMEM;
            goto out;
        }
        for (size_t i = 0; i < live; i++)
            b.perm[i] = i;
        rc = build(&b, 0, live, &root);
        if (rc < 0)
            goto out;
        assert(root == 0);
        rc = gather(ix, b.perm);
        if (rc < 0)
            goto out;
    }
    ix->row_of = malloc((n + 1) * sizeof *ix->row_of);
    if (ix->row_of == NULL) {
        rc = SS_ENOMEM;
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        ix->row_of[i] = -1;
    for (size_t r = 0; r < live; r++)
        ix->row_of[ix->id[r]] = (int64_t)r;
    *out = ix;
    ix = NULL;
out:
    free(b.perm);
    free(b.key);
    ss_geom_index_free(ix);
    if (rc == SS_ENOMEM)
        ss_errinfo_set(err, rc, "geom_index", NULL, -1, NULL);
    return rc;
}

void ss_geom_index_free(ss_geom_index *ix)
{
    if (ix == NULL)
        return;
    free(ix->lo);
    free(ix->hi);
    free(ix->id);
    free(ix->row_of);
    free(ix->nodes);
    free(ix->nlo);
    free(ix->nhi);
    free(ix);
}

size_t ss_geom_index_count(const ss_geom_index *ix)
{
    return ix->n;
}

int ss_geom_index_ndim(const ss_geom_index *ix)
{
    return ix->ndim;
}

/* ---- query -------------------------------------------------------------- */

void ss_overlaps_init(ss_overlaps *o)
{
    memset(o, 0, sizeof *o);
}

void ss_overlaps_destroy(ss_overlaps *o)
{
    if (o == NULL)
        return;
    free(o->request_index);
    free(o->saved_index);
    free(o->saved_offset);
    free(o->request_offset);
    free(o->lengths);
    ss_overlaps_init(o);
}

/* Make room for at least need rows of ndim values. */
static int reserve(ss_overlaps *o, size_t need, int ndim)
{
    size_t nd = (size_t)ndim, cap;
    int64_t *p;

    if (ndim != o->ndim) { /* reused with another index: row width changed */
        ss_overlaps_destroy(o);
        o->ndim = ndim;
    }
    if (need <= o->cap)
        return 0;
    cap = o->cap ? o->cap : 16;
    while (cap < need)
        cap *= 2;
    if (cap > SIZE_MAX / sizeof(int64_t) / (nd ? nd : 1))
        return SS_ENOMEM;
#define SS__GROW(field, width)                                                 \
    do {                                                                       \
        p = realloc(o->field, (cap * (width) + 1) * sizeof *p);                \
        if (p == NULL)                                                         \
            return SS_ENOMEM;                                                  \
        o->field = p;                                                          \
    } while (0)
    SS__GROW(request_index, 1);
    SS__GROW(saved_index, 1);
    SS__GROW(saved_offset, nd);
    SS__GROW(request_offset, nd);
    SS__GROW(lengths, nd);
#undef SS__GROW
    o->cap = cap;
    return 0;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int intersects(int nd, const int64_t *lo, const int64_t *hi,
                      const int64_t *qlo, const int64_t *qhi)
{
    for (int d = 0; d < nd; d++)
        if (lo[d] >= qhi[d] || qlo[d] >= hi[d])
            return 0;
    return 1;
}

/* Append the overlaps of one valid request, tagged with req. */
static int query_one(const ss_geom_index *ix, const int64_t *qoff,
                     const int64_t *qsize, int64_t req, ss_overlaps *out)
{
    int nd = ix->ndim, rc = 0;
    size_t base = out->count, k;
    int64_t qhi[SS_GEOM_MAX_NDIM];

    if (nd == 0) { /* a scalar: every saved box overlaps */
        rc = reserve(out, base + ix->n, nd);
        if (rc < 0)
            goto out;
        for (size_t i = 0; i < ix->n; i++) {
            out->saved_index[base + i] = (int64_t)i;
            out->request_index[base + i] = req;
        }
        out->count = base + ix->n;
        out->visited += ix->n;
        goto out;
    }
    if (box_empty(nd, qsize) || ix->nlive == 0)
        goto out;
    for (int d = 0; d < nd; d++)
        qhi[d] = qoff[d] + qsize[d];

    /* Collect matching ids into saved_index[base..], then sort them. */
    {
        int64_t stack[SS__STACK];
        int top = 0;
        stack[top++] = 0;
        while (top > 0) {
            const geom_node *node = &ix->nodes[stack[--top]];
            int64_t self = node - ix->nodes;
            out->visited++;
            if (!intersects(nd, ix->nlo + self * nd, ix->nhi + self * nd, qoff,
                            qhi))
                continue;
            if (node->left >= 0) {
                assert(top + 2 <= SS__STACK);
                stack[top++] = node->right;
                stack[top++] = node->left;
                continue;
            }
            for (size_t i = node->start; i < node->start + node->count; i++) {
                out->visited++;
                if (!intersects(nd, ix->lo + i * (size_t)nd,
                                ix->hi + i * (size_t)nd, qoff, qhi))
                    continue;
                rc = reserve(out, out->count + 1, nd);
                if (rc < 0)
                    goto out;
                out->saved_index[out->count++] = ix->id[i];
            }
        }
    }
    k = out->count - base;
    if (k > 1)
        qsort(out->saved_index + base, k, sizeof(int64_t), cmp_i64);
    for (size_t j = base; j < out->count; j++) {
        size_t r = (size_t)ix->row_of[out->saved_index[j]] * (size_t)nd;
        out->request_index[j] = req;
        for (int d = 0; d < nd; d++) {
            int64_t alo = ix->lo[r + d], ahi = ix->hi[r + d];
            int64_t lo = alo > qoff[d] ? alo : qoff[d];
            int64_t hi = ahi < qhi[d] ? ahi : qhi[d];
            out->saved_offset[j * nd + d] = lo - alo;
            out->request_offset[j * nd + d] = lo - qoff[d];
            out->lengths[j * nd + d] = hi - lo;
        }
    }
out:
    return rc;
}

static int query_common(const ss_geom_index *ix, size_t m,
                        const int64_t *offsets, const int64_t *sizes,
                        ss_overlaps *out, ss_errinfo *err)
{
    int rc = 0;
    size_t nd = (size_t)ix->ndim;

    rc = reserve(out, 0, ix->ndim);
    if (rc < 0)
        goto out;
    out->count = 0;
    out->visited = 0;
    if (m > 0 && nd > 0 && (offsets == NULL || sizes == NULL)) {
        rc = ss_errinfo_set(err, SS_EINVAL, "geom_query", NULL, -1,
                            "NULL request arrays");
        goto out;
    }
    for (size_t j = 0; j < m; j++) {
        const int64_t *o = offsets + j * nd, *s = sizes + j * nd;
        if (!box_ok(ix->ndim, o, s, err, "geom_query", (int64_t)j)) {
            rc = SS_EINVAL;
            if (err != NULL)
                err->job = (int64_t)j;
            goto out;
        }
        rc = query_one(ix, o, s, (int64_t)j, out);
        if (rc < 0)
            goto out;
    }
out:
    if (rc < 0) {
        out->count = 0;
        if (rc == SS_ENOMEM)
            ss_errinfo_set(err, rc, "geom_query", NULL, -1, NULL);
    }
    return rc;
}

int ss_geom_query(const ss_geom_index *ix, const int64_t *offsets,
                  const int64_t *sizes, ss_overlaps *out, ss_errinfo *err)
{
    return query_common(ix, 1, offsets, sizes, out, err);
}

int ss_geom_query_many(const ss_geom_index *ix, size_t m,
                       const int64_t *offsets, const int64_t *sizes,
                       ss_overlaps *out, ss_errinfo *err)
{
    return query_common(ix, m, offsets, sizes, out, err);
}

/* ---- N-d strided copy --------------------------------------------------- */

typedef struct {
    int nd; /* >= 1 after normalisation */
    int64_t size[SS_GEOM_MAX_NDIM];
    int64_t dstr[SS_GEOM_MAX_NDIM], sstr[SS_GEOM_MAX_NDIM];
    char *dst;
    const char *src;
    size_t elsize;
    int64_t total; /* elements */
    /* Blocked mode (tile > 0): the last two dims are copied in tiles of
     * tile x tile elements; a unit is one tile-row (tile rows of dim nd-2
     * by all of dim nd-1) under one index of the outer dims. */
    int64_t tile, jblocks;
    int64_t work;  /* elements, or units in blocked mode */
    int64_t piece; /* work per pool task */
} copy_plan;

/* *r = a * b for a, b >= 0; 0 on overflow. */
static int mul_ok(int64_t a, int64_t b, int64_t *r)
{
    if (a != 0 && b > INT64_MAX / a)
        return 0;
    *r = a * b;
    return 1;
}

static int64_t abs64(int64_t v)
{
    return v < 0 ? -v : v;
}

/* Copy len elements of one row. Addresses are formed only for elements
 * that exist; memcpy with a constant size compiles to plain moves and
 * carries no alignment requirement. */
static void copy_row(char *d, int64_t ds, const char *s, int64_t ss,
                     int64_t len, size_t elsize)
{
    if (ds == (int64_t)elsize && ss == (int64_t)elsize) {
        ss_copy(d, s, (size_t)len * elsize);
        return;
    }
#define SS__LOOP(N)                                                            \
    for (int64_t i = 0; i < len; i++)                                          \
        memcpy(d + i * ds, s + i * ss, N);                                     \
    break
    switch (elsize) {
    case 1:
        SS__LOOP(1);
    case 2:
        SS__LOOP(2);
    case 4:
        SS__LOOP(4);
    case 8:
        SS__LOOP(8);
    case 16:
        SS__LOOP(16);
    default:
        SS__LOOP(elsize);
    }
#undef SS__LOOP
}

/* Copy the elements [e0, e1) of the row-major order of the plan. */
static void copy_range(const copy_plan *p, int64_t e0, int64_t e1)
{
    int nd = p->nd, outer = nd - 1;
    int64_t inner = p->size[outer];
    int64_t idx[SS_GEOM_MAX_NDIM];
    int64_t r = e0 / inner, c = e0 % inner, doff = 0, soff = 0;

    /* Split the row number into outer indices, innermost fastest. */
    for (int d = outer - 1; d >= 0; d--) {
        idx[d] = r % p->size[d];
        r /= p->size[d];
        doff += idx[d] * p->dstr[d];
        soff += idx[d] * p->sstr[d];
    }
    while (e0 < e1) {
        int64_t len = inner - c < e1 - e0 ? inner - c : e1 - e0;
        copy_row(p->dst + doff + c * p->dstr[outer], p->dstr[outer],
                 p->src + soff + c * p->sstr[outer], p->sstr[outer], len,
                 p->elsize);
        e0 += len;
        c = 0;
        if (e0 >= e1)
            break;
        /* Odometer step over the outer dims. */
        for (int d = outer - 1; d >= 0; d--) {
            if (++idx[d] < p->size[d]) {
                doff += p->dstr[d];
                soff += p->sstr[d];
                break;
            }
            doff -= (p->size[d] - 1) * p->dstr[d];
            soff -= (p->size[d] - 1) * p->sstr[d];
            idx[d] = 0;
        }
    }
}

/* Blocked mode: copy the units [u0, u1). Within a tile, rows of the dst-
 * contiguous dim are written in order while the src lines they read stay
 * in cache for the next rows: a transpose costs sequential traffic. */
static void copy_units(const copy_plan *p, int64_t u0, int64_t u1)
{
    int J = p->nd - 2, I = p->nd - 1;
    int64_t T = p->tile;

    for (int64_t u = u0; u < u1; u++) {
        int64_t r = u / p->jblocks, j0 = (u % p->jblocks) * T;
        int64_t nj = p->size[J] - j0 < T ? p->size[J] - j0 : T;
        int64_t doff = j0 * p->dstr[J], soff = j0 * p->sstr[J];
        for (int d = J - 1; d >= 0; d--) {
            int64_t k = r % p->size[d];
            r /= p->size[d];
            doff += k * p->dstr[d];
            soff += k * p->sstr[d];
        }
        for (int64_t i0 = 0; i0 < p->size[I]; i0 += T) {
            int64_t ni = p->size[I] - i0 < T ? p->size[I] - i0 : T;
            for (int64_t j = 0; j < nj; j++)
                copy_row(p->dst + doff + j * p->dstr[J] + i0 * p->dstr[I],
                         p->dstr[I],
                         p->src + soff + j * p->sstr[J] + i0 * p->sstr[I],
                         p->sstr[I], ni, p->elsize);
        }
    }
}

static void copy_task(void *ctx, size_t i)
{
    const copy_plan *p = ctx;
    int64_t w0 = (int64_t)i * p->piece;
    int64_t w1 = w0 + p->piece < p->work ? w0 + p->piece : p->work;
    if (w0 >= w1)
        return;
    if (p->tile > 0)
        copy_units(p, w0, w1);
    else
        copy_range(p, w0, w1);
}

/* Switch to blocked mode when the dim src walks contiguously is not the
 * innermost (dst-contiguous) one and the innermost one jumps far in src:
 * move that dim next to the innermost and tile the pair. */
static void plan_blocking(copy_plan *p)
{
    int I = p->nd - 1, J = 0;
    int64_t T = 256 / (int64_t)p->elsize;

    p->tile = 0;
    if (p->nd < 2)
        return;
    for (int d = 1; d < p->nd; d++)
        if (abs64(p->sstr[d]) < abs64(p->sstr[J]))
            J = d;
    if (J == I || abs64(p->sstr[I]) < 256 || p->size[J] < 8 || p->size[I] < 8)
        return;
    /* Move J to nd - 2; the order of outer dims does not matter. */
    {
        int64_t sz = p->size[J], ds = p->dstr[J], ss = p->sstr[J];
        for (int d = J; d < I - 1; d++) {
            p->size[d] = p->size[d + 1];
            p->dstr[d] = p->dstr[d + 1];
            p->sstr[d] = p->sstr[d + 1];
        }
        p->size[I - 1] = sz;
        p->dstr[I - 1] = ds;
        p->sstr[I - 1] = ss;
    }
    p->tile = T < 8 ? 8 : (T > 64 ? 64 : T);
    p->jblocks = (p->size[I - 1] + p->tile - 1) / p->tile;
    p->work = p->total / (p->size[I - 1] * p->size[I]) * p->jblocks;
}

/* Byte range [lo, hi) spanned by a region; 0 on int64 overflow. */
static int extent(const copy_plan *p, const int64_t *str, const void *base,
                  uintptr_t *lo, uintptr_t *hi)
{
    int64_t neg = 0, pos = 0, span;
    for (int d = 0; d < p->nd; d++) {
        if (!mul_ok(abs64(str[d]), p->size[d] - 1, &span))
            return 0;
        if (str[d] < 0) {
            if (neg > INT64_MAX - span)
                return 0;
            neg += span;
        } else {
            if (pos > INT64_MAX - span - (int64_t)p->elsize)
                return 0;
            pos += span;
        }
    }
    *lo = (uintptr_t)base - (uintptr_t)neg;
    *hi = (uintptr_t)base + (uintptr_t)pos + p->elsize;
    return 1;
}

int ss_copy_nd(ss_pool *pool, void *dst, const int64_t *dst_strides,
               const void *src, const int64_t *src_strides,
               const int64_t *sizes, int ndim, size_t elsize, ss_errinfo *err)
{
    int rc = 0, same;
    copy_plan p;
    uintptr_t dlo, dhi, slo, shi;
    int64_t bytes;

    if (ndim < 0 || ndim > SS_GEOM_MAX_NDIM || elsize == 0 ||
        elsize > (size_t)INT64_MAX / 2) {
        rc = ss_errinfo_set(err, SS_EINVAL, "copy_nd", NULL, -1,
                            "ndim %d (max %d), elsize %zu", ndim,
                            SS_GEOM_MAX_NDIM, elsize);
        goto out;
    }
    p.nd = 0;
    p.total = 1;
    p.elsize = elsize;
    for (int d = 0; d < ndim; d++) {
        if (sizes[d] < 0) {
            rc = ss_errinfo_set(err, SS_EINVAL, "copy_nd", NULL, -1,
                                "dim %d: negative size %lld", d,
                                (long long)sizes[d]);
            goto out;
        }
        if (!mul_ok(p.total, sizes[d], &p.total)) {
            rc = ss_errinfo_set(err, SS_ERANGE, "copy_nd", NULL, -1,
                                "element count overflows int64");
            goto out;
        }
    }
    if (p.total == 0)
        goto out; /* strides of an empty region never matter */
    for (int d = 0; d < ndim; d++) {
        if (sizes[d] == 1)
            continue; /* its stride never matters */
        if (dst_strides[d] == 0) {
            rc = ss_errinfo_set(err, SS_EINVAL, "copy_nd", NULL, -1,
                                "dim %d: dst stride 0 over %lld elements", d,
                                (long long)sizes[d]);
            goto out;
        }
        p.size[p.nd] = sizes[d];
        p.dstr[p.nd] = dst_strides[d];
        p.sstr[p.nd] = src_strides[d];
        p.nd++;
    }
    if (dst == NULL || src == NULL) {
        rc = ss_errinfo_set(err, SS_EINVAL, "copy_nd", NULL, -1, "NULL buffer");
        goto out;
    }
    if (!extent(&p, p.dstr, dst, &dlo, &dhi) ||
        !extent(&p, p.sstr, src, &slo, &shi) ||
        !mul_ok(p.total, (int64_t)elsize, &bytes)) {
        rc = ss_errinfo_set(err, SS_ERANGE, "copy_nd", NULL, -1,
                            "region byte extent overflows int64");
        goto out;
    }
    if (dlo < shi && slo < dhi) {
        same = dst == src;
        for (int d = 0; d < p.nd && same; d++)
            same = p.dstr[d] == p.sstr[d];
        if (!same)
            rc = ss_errinfo_set(err, SS_EOVERLAP, "copy_nd", NULL, -1,
                                "src and dst memory ranges intersect");
        goto out; /* onto itself: nothing to do */
    }
    p.dst = dst;
    p.src = src;
    if (p.nd == 0) {
        memcpy(p.dst, p.src, elsize);
        goto out;
    }
    /* Walk dims negative in both forwards: same elements, better runs. */
    for (int d = 0; d < p.nd; d++) {
        if (p.dstr[d] < 0 && p.sstr[d] < 0) {
            p.dst += (p.size[d] - 1) * p.dstr[d];
            p.src += (p.size[d] - 1) * p.sstr[d];
            p.dstr[d] = -p.dstr[d];
            p.sstr[d] = -p.sstr[d];
        }
    }
    /* Order dims by falling |dst stride| (then src) so writes are local;
     * any order copies the same element pairs. Insertion sort: nd <= 64. */
    for (int i = 1; i < p.nd; i++) {
        int64_t sz = p.size[i], ds = p.dstr[i], sst = p.sstr[i];
        int j = i;
        while (j > 0 && (abs64(p.dstr[j - 1]) < abs64(ds) ||
                         (abs64(p.dstr[j - 1]) == abs64(ds) &&
                          abs64(p.sstr[j - 1]) < abs64(sst)))) {
            p.size[j] = p.size[j - 1];
            p.dstr[j] = p.dstr[j - 1];
            p.sstr[j] = p.sstr[j - 1];
            j--;
        }
        p.size[j] = sz;
        p.dstr[j] = ds;
        p.sstr[j] = sst;
    }
    /* Merge an outer dim into the next inner one when it steps exactly
     * over the whole inner dim in both buffers. */
    {
        int w = 0;
        for (int d = 1; d < p.nd; d++) {
            int64_t dd, sd;
            if (mul_ok(abs64(p.dstr[d]), p.size[d], &dd) &&
                mul_ok(abs64(p.sstr[d]), p.size[d], &sd) &&
                p.dstr[w] == (p.dstr[d] < 0 ? -dd : dd) &&
                p.sstr[w] == (p.sstr[d] < 0 ? -sd : sd)) {
                p.size[w] *= p.size[d]; /* <= total, no overflow */
                p.dstr[w] = p.dstr[d];
                p.sstr[w] = p.sstr[d];
                continue;
            }
            w++;
            p.size[w] = p.size[d];
            p.dstr[w] = p.dstr[d];
            p.sstr[w] = p.sstr[d];
        }
        p.nd = w + 1;
    }
    p.work = p.total;
    plan_blocking(&p);
    p.piece = p.work;
    if (ss_pool_threads(pool) > 0 && bytes > SS_COPY_PARALLEL_MIN) {
        /* About four pieces per thread for balance, none under 256 KiB. */
        int64_t want = 4 * ((int64_t)ss_pool_threads(pool) + 1);
        int64_t cap = bytes / (256 * 1024);
        int64_t n = want < cap ? want : cap;
        if (n < 2)
            n = 2;
        p.piece = (p.work + n - 1) / n;
    }
    rc = ss_pool_run(pool, (size_t)((p.work + p.piece - 1) / p.piece),
                     copy_task, &p);
out:
    return rc;
}
