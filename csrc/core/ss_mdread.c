/* ss_mdread.c - the .metadata decoder of ss_mdread.h.
 *
 * One pass over the opcodes: a stack and a memo of node indices, the marks
 * as stack positions; allocations grow by doubling and are bounded by the
 * stream (at most one node and a few items per byte). Lists
 * and dicts grow after they are made (APPENDS, SETITEMS may come long
 * after, through the memo), so their items are recorded in a scratch array
 * (the result's kids): a container filled in one batch (nearly all of
 * them: a chunk's state dict, a short list) keeps (offset, count) in its
 * node, with c = SS_MD_ONE_RUN; one filled in several batches gets segments,
 * chained per container, and at the end its items are copied into one run
 * at the end of the array, so the binding sees (offset, count) everywhere.
 * (A segment per container cost 12 bytes a chunk-sized dict: a quarter of
 * the file's size over a large .metadata's decode.) Every argument is
 * checked against the bytes left before it is read.
 *
 * The memo: a pickler memoizes every object it writes, and fetches back
 * few of them (the class globals, the field names, the keys a storage entry
 * shares with a tensor), so a memo of every put index cost 4 bytes for
 * each of tens of millions of entries. A first, cheap pass (prescan) walks
 * the opcodes only to mark the indices any GET names (a bitmap); the
 * decode then keeps the node of a marked index only, at its rank among
 * the marked ones (a prefix count per 64 indices). The prescan stops at
 * anything it cannot step over; the decode refuses there (or before), so
 * the two agree on every index up to the decode's answer. */
#include "ss_mdread.h"

#include <stdlib.h>
#include <string.h>

/* Preallocated nodes: None, False, True, ints 0..255, the empty tuple. */
#define N_NONE 0u
#define N_FALSE 1u
#define N_TRUE 2u
#define N_INT0 3u
#define N_EMPTY_TUPLE (N_INT0 + 256u)
#define N_FIXED (N_EMPTY_TUPLE + 1u)

typedef struct seg {
    uint32_t off, count, next; /* next: segment index + 1, or 0 */
} seg;

/* A list's or dict's c while decoding: 0 (no items yet), SS_MD_ONE_RUN
 * (a: the offset of its items in tmp, one batch), or the last segment's
 * index + 1 (a: the first's). Segment indices stay below it (add_items'
 * bound). */

struct ss_mdread {
    ss_md_result res;
    ss_md_node *nodes;
    size_t ncap;
    uint32_t *kids;
};

/* An open MARK: the stack position, and the table's sizes when it was
 * pushed (a fold drops what was made since); taint: a node made before it
 * was changed since (BUILD, items added), so it may refer to newer ones. */
struct mark {
    size_t sp;
    uint32_t nodes, tmp, segs;
    int taint;
};

typedef struct dec {
    const uint8_t *d;
    size_t len, p;
    ss_mdread *r;
    uint32_t *tmp; /* items in arrival order */
    size_t ntmp, tcap;
    seg *segs;
    size_t nsegs, scap;
    uint32_t *stack;
    size_t sp, stcap;
    struct mark *marks;
    size_t nmarks, mcap;
    uint32_t pin_end; /* 1 + the last node a fetched memo index held, or 0 */
    const ss_md_fold *fold;
    uint64_t *fetched; /* bit i: some GET names memo index i (prescan) */
    uint32_t *rank;    /* per 64 indices: the marked ones before them */
    size_t nwords;     /* words of fetched (and of rank) */
    uint32_t *memo;    /* per marked index, by rank: its node */
    size_t nmemo;      /* indices stored so far (puts come in order) */
    uint32_t *ints;    /* node + 1 of each int 256..65535 made so far */
    ss_errinfo *err;
} dec;

static int grow(void **a, size_t *cap, size_t need, size_t elem)
{
    size_t n = *cap ? *cap : 256;
    void *p;
    if (need <= *cap)
        return 0;
    while (n < need)
        n *= 2;
    if (n > SIZE_MAX / elem)
        return SS_ENOMEM;
    p = realloc(*a, n * elem);
    if (p == NULL)
        return SS_ENOMEM;
    *a = p;
    *cap = n;
    return 0;
}

static int refuse(dec *s, int code, size_t at, const char *why)
{
    return ss_errinfo_set(s->err, code, "mdread", NULL, (int64_t)at, "%s", why);
}

static int new_node(dec *s, uint8_t kind, uint32_t a, uint32_t b, uint32_t *idx)
{
    ss_mdread *r = s->r;
    ss_md_node *n;
    if (r->res.nnodes >= SS_MD_ROW_BIT - 1)
        return refuse(s, SS_ERANGE, s->p, "too many values");
    if (grow((void **)&r->nodes, &r->ncap, r->res.nnodes + 1,
             sizeof *r->nodes) < 0)
        return SS_ENOMEM;
    n = &r->nodes[r->res.nnodes];
    memset(n, 0, sizeof *n);
    n->kind = kind;
    n->a = a;
    n->b = b;
    *idx = (uint32_t)r->res.nnodes++;
    return 0;
}

static int push(dec *s, uint32_t v)
{
    if (grow((void **)&s->stack, &s->stcap, s->sp + 1, sizeof *s->stack) < 0)
        return SS_ENOMEM;
    s->stack[s->sp++] = v;
    return 0;
}

static size_t fence(const dec *s)
{
    return s->nmarks ? s->marks[s->nmarks - 1].sp : 0;
}

/* Pops n values above the fence into *out (a pointer into the stack, valid
 * until the next push). */
static int take(dec *s, size_t n, const uint32_t **out)
{
    if (s->sp - fence(s) < n)
        return refuse(s, SS_EINVAL, s->p, "stack underflow");
    s->sp -= n;
    *out = s->stack + s->sp;
    return 0;
}

static int pop_mark(dec *s, size_t *mark)
{
    if (s->nmarks == 0)
        return refuse(s, SS_EINVAL, s->p, "no MARK");
    *mark = s->marks[--s->nmarks].sp;
    return 0;
}

/* Node i is about to change: every open mark pushed after i was made is
 * tainted (i may come to refer to the nodes made since). */
static void touch(dec *s, uint32_t i)
{
    for (size_t k = s->nmarks; k-- > 0 && s->marks[k].nodes > i;)
        s->marks[k].taint = 1;
}

/* Appends a segment (off, count) to s->segs (room made by the caller). */
static uint32_t new_seg(dec *s, uint32_t off, uint32_t count)
{
    seg *g = &s->segs[s->nsegs];
    g->off = off;
    g->count = count;
    g->next = 0;
    return (uint32_t)++s->nsegs;
}

/* Records items as container node ci's next batch (see SS_MD_ONE_RUN). */
static int add_items(dec *s, uint32_t ci, const uint32_t *items, size_t n)
{
    ss_md_node *c;
    uint32_t off = (uint32_t)s->ntmp, g;
    if (n == 0)
        return 0;
    if (s->ntmp + n >= UINT32_MAX || s->nsegs >= UINT32_MAX - 3)
        return refuse(s, SS_ERANGE, s->p, "too many items");
    if (grow((void **)&s->tmp, &s->tcap, s->ntmp + n, sizeof *s->tmp) < 0)
        return SS_ENOMEM;
    memmove(s->tmp + s->ntmp, items, n * sizeof *items);
    s->ntmp += n;
    touch(s, ci);
    c = &s->r->nodes[ci];
    if (c->c == 0) {
        c->a = off;
        c->c = SS_MD_ONE_RUN;
    } else {
        if (grow((void **)&s->segs, &s->scap, s->nsegs + 2, sizeof *s->segs) <
            0)
            return SS_ENOMEM;
        if (c->c == SS_MD_ONE_RUN) { /* the first batch becomes a segment */
            uint32_t had = c->kind == SS_MD_DICT ? 2 * c->b : c->b;
            c->c = c->a = new_seg(s, c->a, had);
        }
        g = new_seg(s, off, (uint32_t)n);
        s->segs[c->c - 1].next = g;
        c->c = g;
    }
    if (c->kind == SS_MD_DICT)
        n /= 2;
    if (c->b > UINT32_MAX - n)
        return refuse(s, SS_ERANGE, s->p, "too many items");
    c->b += (uint32_t)n;
    return 0;
}

static int make_tuple(dec *s, size_t n)
{
    const uint32_t *items = NULL;
    uint32_t t;
    int rc;
    if (n == 0)
        return push(s, N_EMPTY_TUPLE);
    if ((rc = take(s, n, &items)) < 0)
        return rc;
    if (s->ntmp + n >= UINT32_MAX)
        return refuse(s, SS_ERANGE, s->p, "too many items");
    if (grow((void **)&s->tmp, &s->tcap, s->ntmp + n, sizeof *s->tmp) < 0)
        return SS_ENOMEM;
    /* a tuple's items are final at once: (offset, count) in tmp */
    memcpy(s->tmp + s->ntmp, items, n * sizeof *items);
    if ((rc = new_node(s, SS_MD_TUPLE, (uint32_t)s->ntmp, (uint32_t)n, &t)) < 0)
        return rc;
    s->ntmp += n;
    return push(s, t);
}

static uint64_t le(const uint8_t *p, size_t n)
{
    uint64_t v = 0;
    for (size_t i = n; i-- > 0;)
        v = v << 8 | p[i];
    return v;
}

/* Offers the batch of n items at s->stack + mark, for container ci, to
 * the fold hook, if what was made since mark m is theirs alone (nothing of
 * it fetched later, no older node changed since); when the hook takes it,
 * drops those nodes and puts its rows in the stack in place of the items.
 * 1: folded, 0: not, or an error. */
static int fold(dec *s, const struct mark *m, uint32_t ci, size_t mark,
                size_t n)
{
    ss_mdread *r = s->r;
    uint32_t row0 = 0, rows;
    int rc;
    if (s->fold == NULL || m->taint || s->pin_end > m->nodes || n == 0)
        return 0;
    r->res.nodes = r->nodes;
    r->res.kids = s->tmp;
    r->res.nkids = s->ntmp;
    rc = s->fold->batch(s->fold->ctx, &r->res, ci, s->stack + mark, n, &row0);
    if (rc <= 0)
        return rc;
    rows = (uint32_t)(r->nodes[ci].kind == SS_MD_DICT ? n / 2 : n);
    if (row0 >= SS_MD_ROW_BIT || rows > SS_MD_ROW_BIT - row0)
        return refuse(s, SS_ERANGE, s->p, "too many rows");
    /* the int cache may name dropped nodes */
    for (size_t i = m->nodes; i < r->res.nnodes; i++) {
        const ss_md_node *x = &r->nodes[i];
        uint64_t v = (uint64_t)x->b << 32 | x->a;
        if (x->kind == SS_MD_INT && v < 65536 && s->ints != NULL &&
            s->ints[v] == i + 1)
            s->ints[v] = 0;
    }
    r->res.nnodes = m->nodes;
    s->ntmp = m->tmp;
    s->nsegs = m->segs;
    for (size_t k = 0; k < n; k++) /* a dict's pair: its row twice */
        s->stack[mark + k] =
            (row0 + (uint32_t)(rows == n ? k : k / 2)) | SS_MD_ROW_BIT;
    return 1;
}

/* Appends the items above the last mark to the container below it. */
static int extend(dec *s, uint8_t want)
{
    size_t mark = 0, n;
    struct mark m = {0};
    uint32_t ci;
    int rc;
    if (s->nmarks)
        m = s->marks[s->nmarks - 1];
    if ((rc = pop_mark(s, &mark)) < 0)
        return rc;
    if (mark == 0 || mark < fence(s) + 1)
        return refuse(s, SS_EINVAL, s->p, "no container below MARK");
    ci = s->stack[mark - 1];
    n = s->sp - mark;
    if (s->r->nodes[ci].kind != want || ci < N_FIXED)
        return refuse(s, SS_EINVAL, s->p, "APPENDS/SETITEMS on another type");
    if (want == SS_MD_DICT && n % 2)
        return refuse(s, SS_EINVAL, s->p, "odd number of SETITEMS items");
    if ((rc = fold(s, &m, ci, mark, n)) < 0 ||
        (rc = add_items(s, ci, s->stack + mark, n)) < 0)
        return rc;
    s->sp = mark;
    return 0;
}

static int append1(dec *s, uint8_t want, size_t n)
{
    const uint32_t *items = NULL;
    uint32_t ci;
    int rc;
    if ((rc = take(s, n, &items)) < 0)
        return rc;
    if (s->sp <= fence(s))
        return refuse(s, SS_EINVAL, s->p, "stack underflow");
    ci = s->stack[s->sp - 1];
    if (s->r->nodes[ci].kind != want || ci < N_FIXED)
        return refuse(s, SS_EINVAL, s->p, "APPEND/SETITEM on another type");
    return add_items(s, ci, items, n);
}

static unsigned pop64(uint64_t x)
{
    x -= (x >> 1) & 0x5555555555555555ull;
    x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
    x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0full;
    return (unsigned)((x * 0x0101010101010101ull) >> 56);
}

/* The slot in s->memo of memo index i, or -1: no GET names it. */
static int64_t memo_slot(const dec *s, uint64_t i)
{
    uint64_t w = i / 64, bit = (uint64_t)1 << (i % 64);
    if (w >= s->nwords || !(s->fetched[w] & bit))
        return -1;
    return (int64_t)s->rank[w] + pop64(s->fetched[w] & (bit - 1));
}

static int memo_put(dec *s, uint64_t i)
{
    int64_t slot;
    if (s->sp <= fence(s))
        return refuse(s, SS_EINVAL, s->p, "memo of nothing");
    if (i > s->nmemo)
        return refuse(s, SS_ERANGE, s->p, "memo index out of order");
    if (i == s->nmemo)
        s->nmemo++;
    if ((slot = memo_slot(s, i)) >= 0) {
        s->memo[slot] = s->stack[s->sp - 1];
        if (s->memo[slot] >= s->pin_end)
            s->pin_end = s->memo[slot] + 1;
    }
    return 0;
}

static int memo_get(dec *s, uint64_t i)
{
    ss_md_node *n;
    int64_t slot;
    if (i >= s->nmemo)
        return refuse(s, SS_ERANGE, s->p, "memo index not stored");
    /* the prescan marked every index a GET names below its nmemo */
    if ((slot = memo_slot(s, i)) < 0)
        return refuse(s, SS_EINVAL, s->p, "memo index not prescanned");
    n = &s->r->nodes[s->memo[slot]];
    if (n->share == 0) {
        if (s->r->res.shared == SS_MD_SHARE_MAX)
            return refuse(s, SS_ERANGE, s->p, "too many shared values");
        n->share = ++s->r->res.shared;
    }
    return push(s, s->memo[slot]);
}

/* Length-prefixed strings and bytes: w-byte length, then the data. */
static int blob(dec *s, uint8_t kind, size_t w)
{
    uint64_t n;
    uint32_t idx;
    int rc;
    if (s->len - s->p < w)
        return refuse(s, SS_ERANGE, s->p, "truncated length");
    n = le(s->d + s->p, w);
    s->p += w;
    if (n > s->len - s->p)
        return refuse(s, SS_ERANGE, s->p, "string past the end");
    if ((rc = new_node(s, kind, (uint32_t)s->p, (uint32_t)n, &idx)) < 0)
        return rc;
    s->p += (size_t)n;
    return push(s, idx);
}

static int line(dec *s, uint32_t *idx)
{
    const uint8_t *nl = memchr(s->d + s->p, '\n', s->len - s->p);
    size_t n;
    int rc;
    if (nl == NULL)
        return refuse(s, SS_ERANGE, s->p, "GLOBAL without newline");
    n = (size_t)(nl - (s->d + s->p));
    if ((rc = new_node(s, SS_MD_STR, (uint32_t)s->p, (uint32_t)n, idx)) < 0)
        return rc;
    s->p += n + 1;
    return 0;
}

static int int_node(dec *s, int64_t v)
{
    uint32_t idx;
    int rc;
    uint64_t u = (uint64_t)v;
    if (v >= 0 && v < 256)
        return push(s, N_INT0 + (uint32_t)v);
    if (v > 0 && v < 65536 && s->ints == NULL &&
        (s->ints = calloc(65536, sizeof *s->ints)) == NULL)
        return SS_ENOMEM;
    if (v > 0 && v < 65536 && s->ints[v])
        return push(s, s->ints[v] - 1);
    if ((rc = new_node(s, SS_MD_INT, (uint32_t)u, (uint32_t)(u >> 32), &idx)) <
        0)
        return rc;
    if (v > 0 && v < 65536)
        s->ints[v] = idx + 1;
    return push(s, idx);
}

/* NEWOBJ / REDUCE: (callable, args) -> a node. */
static int call(dec *s, uint8_t kind)
{
    const uint32_t *v = NULL;
    uint32_t idx;
    int rc;
    if ((rc = take(s, 2, &v)) < 0)
        return rc;
    if (s->r->nodes[v[1]].kind != SS_MD_TUPLE)
        return refuse(s, SS_EINVAL, s->p, "arguments are not a tuple");
    if ((rc = new_node(s, kind, v[0], v[1], &idx)) < 0)
        return rc;
    return push(s, idx);
}

static int step(dec *s, uint8_t op)
{
    const uint32_t *v = NULL;
    uint32_t idx, a;
    size_t mark = 0;
    int rc;

#define NEED(n)                                                                \
    do {                                                                       \
        if (s->len - s->p < (n))                                               \
            return refuse(s, SS_ERANGE, s->p, "truncated argument");           \
    } while (0)

    switch (op) {
    case 'N':
        return push(s, N_NONE);
    case 0x88:
        return push(s, N_TRUE);
    case 0x89:
        return push(s, N_FALSE);
    case 'K':
        NEED(1);
        return int_node(s, s->d[s->p++]);
    case 'M':
        NEED(2);
        s->p += 2;
        return int_node(s, (int64_t)le(s->d + s->p - 2, 2));
    case 'J':
        NEED(4);
        s->p += 4;
        return int_node(s, (int32_t)(uint32_t)le(s->d + s->p - 4, 4));
    case 0x8a: { /* LONG1: little-endian two's complement */
        size_t n;
        uint64_t u;
        NEED(1);
        n = s->d[s->p++];
        NEED(n);
        if (n > 8)
            return refuse(s, SS_EINVAL, s->p, "int beyond int64");
        u = le(s->d + s->p, n);
        if (n > 0 && n < 8 && (s->d[s->p + n - 1] & 0x80))
            u |= ~(uint64_t)0 << (8 * n);
        s->p += n;
        return int_node(s, (int64_t)u);
    }
    case 'G': {
        uint64_t u = 0;
        NEED(8);
        for (size_t i = 0; i < 8; i++)
            u = u << 8 | s->d[s->p + i];
        s->p += 8;
        if ((rc = new_node(s, SS_MD_FLOAT, (uint32_t)u, (uint32_t)(u >> 32),
                           &idx)) < 0)
            return rc;
        return push(s, idx);
    }
    case 0x8c:
        return blob(s, SS_MD_STR, 1);
    case 'X':
        return blob(s, SS_MD_STR, 4);
    case 0x8d:
        return blob(s, SS_MD_STR, 8);
    case 'C':
        return blob(s, SS_MD_BYTES, 1);
    case 'B':
        return blob(s, SS_MD_BYTES, 4);
    case 0x8e:
        return blob(s, SS_MD_BYTES, 8);
    case ')':
        return push(s, N_EMPTY_TUPLE);
    case 0x85:
    case 0x86:
    case 0x87:
        return make_tuple(s, (size_t)(op - 0x84));
    case 't':
        if ((rc = pop_mark(s, &mark)) < 0)
            return rc;
        if (mark < fence(s) || mark > s->sp)
            return refuse(s, SS_EINVAL, s->p, "bad MARK");
        return make_tuple(s, s->sp - mark);
    case '(':
        if (grow((void **)&s->marks, &s->mcap, s->nmarks + 1,
                 sizeof *s->marks) < 0)
            return SS_ENOMEM;
        s->marks[s->nmarks].sp = s->sp;
        s->marks[s->nmarks].nodes = (uint32_t)s->r->res.nnodes;
        s->marks[s->nmarks].tmp = (uint32_t)s->ntmp;
        s->marks[s->nmarks].segs = (uint32_t)s->nsegs;
        s->marks[s->nmarks++].taint = 0;
        return 0;
    case ']':
    case '}':
        if ((rc = new_node(s, op == ']' ? SS_MD_LIST : SS_MD_DICT, 0, 0,
                           &idx)) < 0)
            return rc;
        return push(s, idx);
    case 'a':
        return append1(s, SS_MD_LIST, 1);
    case 'e':
        return extend(s, SS_MD_LIST);
    case 's':
        return append1(s, SS_MD_DICT, 2);
    case 'u':
        return extend(s, SS_MD_DICT);
    case 'c':
        if ((rc = line(s, &a)) < 0 || (rc = line(s, &idx)) < 0)
            return rc;
        if ((rc = new_node(s, SS_MD_GLOBAL, a, idx, &idx)) < 0)
            return rc;
        return push(s, idx);
    case 0x93:
        if ((rc = take(s, 2, &v)) < 0)
            return rc;
        if (s->r->nodes[v[0]].kind != SS_MD_STR ||
            s->r->nodes[v[1]].kind != SS_MD_STR)
            return refuse(s, SS_EINVAL, s->p, "STACK_GLOBAL of non-strings");
        if ((rc = new_node(s, SS_MD_GLOBAL, v[0], v[1], &idx)) < 0)
            return rc;
        return push(s, idx);
    case 0x81:
        return call(s, SS_MD_NEWOBJ);
    case 'R':
        return call(s, SS_MD_REDUCE);
    case 'b': {
        ss_md_node *o;
        if ((rc = take(s, 1, &v)) < 0)
            return rc;
        if (s->sp <= fence(s))
            return refuse(s, SS_EINVAL, s->p, "stack underflow");
        o = &s->r->nodes[s->stack[s->sp - 1]];
        if ((o->kind != SS_MD_NEWOBJ && o->kind != SS_MD_REDUCE) || o->c)
            return refuse(s, SS_EINVAL, s->p, "BUILD on another value");
        touch(s, s->stack[s->sp - 1]);
        o->c = v[0] + 1;
        return 0;
    }
    case 0x94:
        return memo_put(s, s->nmemo);
    case 'q':
        NEED(1);
        return memo_put(s, s->d[s->p++]);
    case 'r':
        NEED(4);
        s->p += 4;
        return memo_put(s, le(s->d + s->p - 4, 4));
    case 'h':
        NEED(1);
        return memo_get(s, s->d[s->p++]);
    case 'j':
        NEED(4);
        s->p += 4;
        return memo_get(s, le(s->d + s->p - 4, 4));
    default:
        return refuse(s, SS_EINVAL, s->p - 1, "opcode outside the decoded set");
    }
#undef NEED
}

/* Gives every list and dict its items as one range of tmp: a container
 * filled in one batch (the usual case) already has one; the items of one
 * filled in several are copied to the end. tmp becomes the result's kids. */
static int flatten(dec *s)
{
    ss_mdread *r = s->r;
    for (size_t i = N_FIXED; i < r->res.nnodes; i++) {
        ss_md_node *n = &r->nodes[i];
        uint32_t g;
        size_t total = 0;
        int contiguous = 1;
        if (n->kind != SS_MD_LIST && n->kind != SS_MD_DICT)
            continue;
        g = n->a;
        if (n->c == 0 || n->c == SS_MD_ONE_RUN) {
            n->a = n->c ? n->a : 0;
            n->c = 0;
            continue;
        }
        n->c = 0;
        for (uint32_t h = g; h; h = s->segs[h - 1].next) {
            if (s->segs[h - 1].off != s->segs[g - 1].off + total)
                contiguous = 0;
            total += s->segs[h - 1].count;
        }
        if (contiguous) { /* batches with nothing between: one run already */
            n->a = (uint32_t)s->segs[g - 1].off;
            continue;
        }
        if (s->ntmp + total >= UINT32_MAX)
            return refuse(s, SS_ERANGE, s->p, "too many items");
        if (grow((void **)&s->tmp, &s->tcap, s->ntmp + total, sizeof *s->tmp) <
            0)
            return SS_ENOMEM;
        n->a = (uint32_t)s->ntmp;
        for (uint32_t h = g; h; h = s->segs[h - 1].next) {
            const seg *sg = &s->segs[h - 1];
            memcpy(s->tmp + s->ntmp, s->tmp + sg->off,
                   sg->count * sizeof *s->tmp);
            s->ntmp += sg->count;
        }
    }
    r->kids = s->tmp;
    r->res.nkids = s->ntmp;
    s->tmp = NULL;
    return 0;
}

/* Bytes an opcode's argument takes at d[p, len) (the opcode at d[p - 1]),
 * with *idx the memo index of a PUT or GET; 0: an opcode without one;
 * -1: not one the decode knows, or the argument is cut off. */
static int64_t arg_len(const uint8_t *d, size_t p, size_t len, uint8_t op,
                       uint64_t *idx)
{
    size_t left = len - p, w;
    switch (op) {
    case 'K':
    case 'q':
    case 'h':
    case 'C':
    case 0x8c:
    case 0x8a:
        w = 1;
        break;
    case 'M':
        w = 2;
        break;
    case 'J':
    case 'r':
    case 'j':
    case 'X':
    case 'B':
        w = 4;
        break;
    case 'G':
    case 0x95:
    case 0x8d:
    case 0x8e:
        w = 8;
        break;
    case 'c': {
        const uint8_t *a = memchr(d + p, '\n', left), *b;
        if (a == NULL)
            return -1;
        b = memchr(a + 1, '\n', (size_t)(d + len - (a + 1)));
        return b == NULL ? -1 : (int64_t)(b + 1 - (d + p));
    }
    case 'N':
    case 0x88:
    case 0x89:
    case ')':
    case 0x85:
    case 0x86:
    case 0x87:
    case 't':
    case '(':
    case ']':
    case '}':
    case 'a':
    case 'e':
    case 's':
    case 'u':
    case 0x93:
    case 0x81:
    case 'R':
    case 'b':
    case 0x94:
        return 0;
    default:
        return -1;
    }
    if (left < w)
        return -1;
    *idx = le(d + p, w);
    if (op == 0x8c || op == 'X' || op == 0x8d || op == 'C' || op == 'B' ||
        op == 0x8e || op == 0x8a) {
        if (*idx > left - w)
            return -1;
        return (int64_t)(w + *idx);
    }
    return (int64_t)w;
}

/* The first pass (see the file's head): s->fetched, s->rank, s->memo. */
static int prescan(dec *s)
{
    size_t p = 2, nmemo = 0, marked = 0;
    int rc = 0;
    for (;;) {
        uint8_t op;
        uint64_t i = 0;
        int64_t n;
        if (p >= s->len || (op = s->d[p++]) == '.')
            break;
        if ((n = arg_len(s->d, p, s->len, op, &i)) < 0)
            break;
        p += (size_t)n;
        if (op == 0x94 || op == 'q' || op == 'r') {
            if (op == 0x94)
                i = nmemo;
            if (i > nmemo)
                break; /* the decode refuses it */
            if (i == nmemo) {
                nmemo++;
                if ((rc = grow((void **)&s->fetched, &s->nwords,
                               (nmemo + 63) / 64, sizeof *s->fetched)) < 0)
                    return rc;
                if ((nmemo - 1) % 64 == 0) /* a new word */
                    s->fetched[(nmemo - 1) / 64] = 0;
            }
        } else if ((op == 'h' || op == 'j') && i < nmemo) {
            s->fetched[i / 64] |= (uint64_t)1 << (i % 64);
        }
    }
    /* grow() left nwords a capacity: clear the words past the last used */
    if (s->nwords > (nmemo + 63) / 64)
        memset(s->fetched + (nmemo + 63) / 64, 0,
               (s->nwords - (nmemo + 63) / 64) * sizeof *s->fetched);
    if (s->nwords && (s->rank = malloc(s->nwords * sizeof *s->rank)) == NULL)
        return SS_ENOMEM;
    for (size_t w = 0; w < s->nwords; w++) {
        s->rank[w] = (uint32_t)marked;
        marked += (size_t)pop64(s->fetched[w]);
    }
    if (marked && (s->memo = malloc(marked * sizeof *s->memo)) == NULL)
        return SS_ENOMEM;
    return 0;
}

static int run(dec *s)
{
    size_t frame_end = 0;
    int rc;
    uint32_t idx;

    /* the fixed nodes */
    for (uint32_t i = 0; i < N_FIXED; i++) {
        uint8_t kind = i == N_NONE         ? SS_MD_NONE
                       : i == N_FALSE      ? SS_MD_FALSE
                       : i == N_TRUE       ? SS_MD_TRUE
                       : i < N_EMPTY_TUPLE ? SS_MD_INT
                                           : SS_MD_TUPLE;
        if ((rc = new_node(s, kind, kind == SS_MD_INT ? i - N_INT0 : 0, 0,
                           &idx)) < 0)
            return rc;
    }
    if (s->len < 2 || s->d[0] != 0x80 || s->d[1] < 3 || s->d[1] > 5)
        return refuse(s, SS_EINVAL, 0, "not protocol 3-5");
    s->r->res.proto = s->d[1];
    if ((rc = prescan(s)) < 0)
        return rc;
    s->p = 2;
    for (;;) {
        uint8_t op;
        if (frame_end && s->p >= frame_end)
            frame_end = 0;
        if (s->p >= s->len)
            return refuse(s, SS_ERANGE, s->p, "no STOP");
        op = s->d[s->p++];
        if (op == '.') {
            if (s->sp != 1 || s->nmarks)
                return refuse(s, SS_EINVAL, s->p - 1, "STOP with a stack");
            s->r->res.root = s->stack[0];
            return flatten(s);
        }
        if (op == 0x95) { /* FRAME */
            uint64_t n;
            if (frame_end)
                return refuse(s, SS_EINVAL, s->p - 1, "FRAME in a FRAME");
            if (s->len - s->p < 8)
                return refuse(s, SS_ERANGE, s->p, "truncated FRAME");
            n = le(s->d + s->p, 8);
            s->p += 8;
            if (n > s->len - s->p)
                return refuse(s, SS_ERANGE, s->p, "FRAME past the end");
            frame_end = s->p + (size_t)n;
            continue;
        }
        if ((rc = step(s, op)) < 0)
            return rc;
        if (frame_end && s->p > frame_end)
            return refuse(s, SS_ERANGE, s->p, "opcode across a FRAME's end");
    }
}

int ss_mdread_decode(const void *data, size_t len, ss_mdread **out,
                     ss_errinfo *err)
{
    return ss_mdread_decode_fold(data, len, NULL, out, err);
}

int ss_mdread_decode_fold(const void *data, size_t len, const ss_md_fold *fold,
                          ss_mdread **out, ss_errinfo *err)
{
    dec s;
    int rc;

    *out = NULL;
    memset(&s, 0, sizeof s);
    s.fold = fold;
    s.d = data;
    s.len = len;
    s.err = err;
    if (len >= UINT32_MAX)
        return refuse(&s, SS_ERANGE, 0, "stream of 4 GiB or more");
    if ((s.r = calloc(1, sizeof *s.r)) == NULL)
        return SS_ENOMEM;
    rc = run(&s);
    if (rc == SS_ENOMEM)
        ss_errinfo_set(err, rc, "mdread", NULL, (int64_t)s.p, NULL);
    free(s.tmp);
    free(s.segs);
    free(s.stack);
    free(s.marks);
    free(s.memo);
    free(s.fetched);
    free(s.rank);
    free(s.ints);
    if (rc < 0) {
        ss_mdread_free(s.r);
        return rc;
    }
    s.r->res.nodes = s.r->nodes;
    s.r->res.kids = s.r->kids;
    *out = s.r;
    return 0;
}

const ss_md_result *ss_mdread_result(const ss_mdread *r)
{
    return &r->res;
}

void ss_mdread_free(ss_mdread *r)
{
    if (r == NULL)
        return;
    free(r->nodes);
    free(r->kids);
    free(r);
}
