/* ss_zipread.c - torch.save tensor record recognition (see ss_zipread.h).
 *
 * Two parts, each the C twin of its Python reference in _zipfmt.py:
 *   zip     (_parse_zip, _check_local, _entry_end): the end records, the
 *           central directory, each local header, the data descriptors, the
 *           entries back to back;
 *   pickle  (_walk_pickle, _reduce, _persistent_load): data.pkl's opcodes
 *           run over a table of plain values (ints, bools, ASCII strings,
 *           tuples as ranges of a kids array, allowed globals, the conj/neg
 *           dict, storage references, the tensor), never an object.
 * Invariants: every read of the buffer goes through need() or a range
 * checked against len first; value and kid indices are below their
 * tables' counts; integers are int64 and every sum or product of them is
 * checked for overflow. Thread-safe: all state is in one call's ctx.
 */
#include "ss_zipread.h"
#include "ss_crc.h"
#include "ss_zipdtype.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define U32 0xFFFFFFFFu
#define SIG_LFH 0x04034B50u
#define SIG_CDH 0x02014B50u
#define SIG_DD 0x08074B50u
#define SIG_EOCD 0x06054B50u
#define SIG_Z64_EOCD 0x06064B50u
#define SIG_Z64_LOC 0x07064B50u
#define MAX_KIDS 8192
#define MAX_MEMO 256
#define MAX_STACK (4 * SS_ZIP_MAX_NDIM + 32)

static uint16_t rd16(const unsigned char *p)
{
    return (uint16_t)(p[0] | p[1] << 8);
}
static uint32_t rd32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
           (uint32_t)p[3] << 24;
}
static uint64_t rd64(const unsigned char *p)
{
    return (uint64_t)rd32(p) | (uint64_t)rd32(p + 4) << 32;
}

/* A refusal: SS_EINVAL, what and where in err's detail. */
static int refuse(ss_errinfo *err, const char *what, uint64_t at)
{
    ss_errinfo_set(err, SS_EINVAL, "zipread", NULL, -1, "%s (at %llu)", what,
                   (unsigned long long)at);
    return SS_EINVAL;
}
#define FAIL(what, at) return refuse(err, (what), (at))

/* [ofs, ofs + n) lies inside [0, limit). */
static int inside(uint64_t ofs, uint64_t n, uint64_t limit)
{
    return ofs <= limit && n <= limit - ofs;
}

/* ---- zip ----------------------------------------------------------------- */

typedef struct {
    const unsigned char *name; /* without the "<archive>/" prefix */
    size_t nlen;
    uint64_t header, data, size;
    uint32_t crc;
} entry;

/* An extra field block: refused when malformed or a tag repeats; *z64 and
 * *z64len locate tag 1's payload (NULL when absent). */
static int parse_extra(const unsigned char *x, size_t n, uint64_t where,
                       const unsigned char **z64, size_t *z64len,
                       ss_errinfo *err)
{
    uint16_t seen[64];
    size_t nseen = 0;
    *z64 = NULL;
    *z64len = 0;
    for (size_t i = 0; i < n;) {
        uint16_t tag, k;
        if (n - i < 4)
            FAIL("truncated extra field", where);
        tag = rd16(x + i);
        k = rd16(x + i + 2);
        if (k > n - i - 4)
            FAIL("extra field overruns its header", where);
        for (size_t s = 0; s < nseen; s++)
            if (seen[s] == tag)
                FAIL("duplicate extra field", where);
        if (nseen == 64)
            FAIL("too many extra fields", where);
        seen[nseen++] = tag;
        if (tag == 1) {
            *z64 = x + i + 4;
            *z64len = k;
        }
        i += 4 + (size_t)k;
    }
    return 0;
}

static int printable(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] < 0x20 || s[i] > 0x7E)
            return 0;
    return 1;
}

/* The local header at ofs of a central directory entry (limit: the
 * directory's start); fills e. */
static int check_local(const unsigned char *b, uint64_t ofs,
                       const unsigned char *name_raw, size_t nraw,
                       uint16_t flags, uint32_t crc, uint64_t size,
                       uint64_t limit, entry *e, ss_errinfo *err)
{
    const unsigned char *h;
    uint64_t data;
    if (!inside(ofs, 30, limit))
        FAIL("local file header runs past the directory", ofs);
    h = b + ofs;
    if (rd32(h) != SIG_LFH)
        FAIL("bad local header signature", ofs);
    if (rd16(h + 6) != flags || rd16(h + 8) != 0)
        FAIL("local header disagrees with the central directory", ofs);
    data = ofs + 30 + rd16(h + 26) + rd16(h + 28);
    if (data > limit || rd16(h + 26) != nraw ||
        memcmp(h + 30, name_raw, nraw) != 0)
        FAIL("local header has a different name or overruns", ofs);
    if (!inside(data, size, limit))
        FAIL("record data runs past the directory", data);
    if (!(flags & 8) &&
        (rd32(h + 14) != crc || rd32(h + 22) != (size < U32 ? size : U32) ||
         rd32(h + 18) != (size < U32 ? size : U32)))
        FAIL("local header disagrees on CRC or size", ofs);
    e->header = ofs;
    e->data = data;
    e->size = size;
    e->crc = crc;
    return 0;
}

/* Where entry e ends: its data, and its data descriptor if it has one. */
static int entry_end(const unsigned char *b, size_t len, const entry *e,
                     uint64_t *end, ss_errinfo *err)
{
    const unsigned char *h = b + e->header, *z = NULL;
    size_t zlen = 0, dd;
    uint64_t xs, at = e->data + e->size;
    int rc;
    if (!(rd16(h + 6) & 8)) {
        *end = at;
        return 0;
    }
    xs = e->header + 30 + rd16(h + 26);
    rc = parse_extra(b + xs, rd16(h + 28), e->header, &z, &zlen, err);
    if (rc < 0)
        return rc;
    dd = z != NULL ? 24 : 16;
    if (!inside(at, dd, len))
        FAIL("data descriptor runs past the record", at);
    if (rd32(b + at) != SIG_DD || rd32(b + at + 4) != e->crc ||
        (z != NULL
             ? rd64(b + at + 8) != e->size || rd64(b + at + 16) != e->size
             : rd32(b + at + 8) != e->size || rd32(b + at + 12) != e->size))
        FAIL("data descriptor disagrees with the central directory", at);
    *end = at + dd;
    return 0;
}

static int parse_zip(const unsigned char *b, size_t len, entry *ents,
                     size_t *nents, ss_errinfo *err)
{
    const unsigned char *p, *archive = NULL;
    size_t alen = 0;
    uint64_t eocd, loc, z64, n64, cd_size, cd_ofs, pos, cursor = 0;
    uint32_t n32;

    if (len < 22 + 20 + 56)
        FAIL("too short for the zip64 end records", len);
    eocd = len - 22;
    p = b + eocd;
    if (rd32(p) != SIG_EOCD || rd16(p + 20) != 0 || rd16(p + 4) ||
        rd16(p + 6) || rd16(p + 8) != rd16(p + 10))
        FAIL("bad end-of-central-directory record", eocd);
    loc = eocd - 20;
    p = b + loc;
    if (rd32(p) != SIG_Z64_LOC || rd32(p + 4) != 0 || rd32(p + 16) != 1)
        FAIL("bad zip64 end-of-central-directory locator", loc);
    z64 = rd64(p + 8);
    if (z64 != loc - 56)
        FAIL("zip64 end record is not before its locator", z64);
    p = b + z64;
    n64 = rd64(p + 32);
    cd_size = rd64(p + 40);
    cd_ofs = rd64(p + 48);
    if (rd32(p) != SIG_Z64_EOCD || rd64(p + 4) != 44 || rd32(p + 16) ||
        rd32(p + 20) || rd64(p + 24) != n64)
        FAIL("bad zip64 end-of-central-directory record", z64);
    if (n64 == 0 || n64 > SS_ZIP_MAX_ENTRIES)
        FAIL("entry count outside 1..64", n64);
    n32 = rd32(b + eocd + 12);
    if (rd16(b + eocd + 10) != n64 || n32 != (cd_size < U32 ? cd_size : U32) ||
        rd32(b + eocd + 16) != (cd_ofs < U32 ? cd_ofs : U32))
        FAIL("end record disagrees with the zip64 end record", eocd);
    if (cd_ofs > z64 || cd_size != z64 - cd_ofs)
        FAIL("central directory does not end at the zip64 end record", cd_ofs);

    pos = cd_ofs;
    for (uint64_t k = 0; k < n64; k++) {
        const unsigned char *name, *extra, *z, *slash;
        uint16_t flags, nlen, xlen, clen;
        uint64_t usize, csize, ofs, var_end;
        size_t zlen, zi = 0;
        int rc;
        if (!inside(pos, 46, z64))
            FAIL("central directory header runs past the directory", pos);
        p = b + pos;
        flags = rd16(p + 8);
        nlen = rd16(p + 28);
        xlen = rd16(p + 30);
        clen = rd16(p + 32);
        if (rd32(p) != SIG_CDH)
            FAIL("bad central directory signature", pos);
        if (rd16(p + 10) != 0 || (flags & 1))
            FAIL("entry is compressed or encrypted", pos);
        var_end = pos + 46 + nlen + xlen + clen;
        if (var_end > z64)
            FAIL("central directory entry overruns the directory", pos);
        name = p + 46;
        extra = name + nlen;
        if (!printable(name, nlen))
            FAIL("entry name is not printable ASCII", pos);
        rc = parse_extra(extra, xlen, pos, &z, &zlen, err);
        if (rc < 0)
            return rc;
        usize = rd32(p + 24);
        csize = rd32(p + 20);
        ofs = rd32(p + 42);
        {
            size_t need = (usize == U32) + (csize == U32) + (ofs == U32);
            if (need > 0 && (z == NULL || zlen != 8 * need))
                FAIL("zip64 extra missing or of the wrong length", pos);
        }
        if (usize == U32)
            usize = rd64(z + 8 * zi++);
        if (csize == U32)
            csize = rd64(z + 8 * zi++);
        if (ofs == U32)
            ofs = rd64(z + 8 * zi++);
        if (csize != usize)
            FAIL("stored entry's compressed size differs from its size", pos);
        slash = memchr(name, '/', nlen);
        if (slash == NULL || slash == name || slash == name + nlen - 1)
            FAIL("entry name is not '<archive>/<name>'", pos);
        if (archive == NULL) {
            archive = name;
            alen = (size_t)(slash - name);
        } else if ((size_t)(slash - name) != alen ||
                   memcmp(name, archive, alen) != 0) {
            FAIL("entry outside the archive folder", pos);
        }
        ents[k].name = slash + 1;
        ents[k].nlen = (size_t)(name + nlen - slash - 1);
        rc = check_local(b, ofs, name, nlen, flags, rd32(p + 16), usize, cd_ofs,
                         &ents[k], err);
        if (rc < 0)
            return rc;
        pos = var_end;
    }
    if (pos != z64)
        FAIL("central directory has trailing bytes", pos);
    for (uint64_t k = 0; k < n64; k++) {
        int rc;
        if (ents[k].header != cursor)
            FAIL("entries are not back to back", ents[k].header);
        for (uint64_t j = 0; j < k; j++)
            if (ents[j].nlen == ents[k].nlen &&
                memcmp(ents[j].name, ents[k].name, ents[k].nlen) == 0)
                FAIL("duplicate entry", ents[k].header);
        rc = entry_end(b, len, &ents[k], &cursor, err);
        if (rc < 0)
            return rc;
    }
    if (cursor != cd_ofs)
        FAIL("entries do not end where the central directory starts", cursor);
    *nents = (size_t)n64;
    return 0;
}

/* ---- data.pkl ------------------------------------------------------------ */

enum {
    V_MARK,
    V_INT,
    V_BOOL,
    V_STR,
    V_TUPLE,
    V_GLOBAL,
    V_DICT,
    V_ODICT,
    V_STORAGE,
    V_TENSOR
};
/* Global codes; typed storages and v3 dtypes add their ss_zip_dtypes index. */
enum { G_V2, G_V3, G_ODICT, G_UNTYPED, G_STORAGE = 16, G_DTYPE = 64 };

typedef struct {
    int kind;
    int64_t i;         /* INT, BOOL; GLOBAL code; STORAGE numel */
    uint32_t off, len; /* STR, STORAGE key: bytes of the pickle; TUPLE kids */
    int a, b;          /* DICT conj, neg (-1 absent); STORAGE dtype (-1) */
} val;

typedef struct {
    const unsigned char *p;
    size_t n, i;
    val *v;
    size_t nv;
    uint32_t *kids;
    size_t nkids;
    uint32_t stack[MAX_STACK + 8];
    size_t sp;
    uint32_t memo_key[MAX_MEMO], memo_val[MAX_MEMO];
    size_t nmemo;
    ss_zip_tensor *t;
    int have_tensor;
    ss_errinfo *err;
} pk;

#define PFAIL(what) return refuse(c->err, "data.pkl: " what, c->i)

static int take(pk *c, size_t k, const unsigned char **out)
{
    ss_errinfo *err = c->err;
    if (k > c->n - c->i)
        FAIL("data.pkl is truncated", c->i);
    *out = c->p + c->i;
    c->i += k;
    return 0;
}

static int push(pk *c, val v)
{
    if (c->nv == SS_ZIP_MAX_VALUES)
        PFAIL("too many values");
    if (c->sp >= MAX_STACK + 8)
        PFAIL("stack too deep");
    c->v[c->nv] = v;
    c->stack[c->sp++] = (uint32_t)c->nv++;
    return 0;
}

static int push_ref(pk *c, uint32_t idx)
{
    if (c->sp >= MAX_STACK + 8)
        PFAIL("stack too deep");
    c->stack[c->sp++] = idx;
    return 0;
}

static int pop(pk *c, uint32_t *out)
{
    if (c->sp == 0 || c->v[c->stack[c->sp - 1]].kind == V_MARK)
        PFAIL("pops an empty stack");
    *out = c->stack[--c->sp];
    return 0;
}

/* The values above the topmost MARK, as a kids range; the MARK goes. */
static int pop_mark(pk *c, uint32_t *off, uint32_t *cnt)
{
    size_t j = c->sp;
    while (j > 0 && c->v[c->stack[j - 1]].kind != V_MARK)
        j--;
    if (j == 0)
        PFAIL("no MARK to close");
    if (c->sp - j > MAX_KIDS - c->nkids)
        PFAIL("too many tuple items");
    *off = (uint32_t)c->nkids;
    *cnt = (uint32_t)(c->sp - j);
    for (size_t k = j; k < c->sp; k++)
        c->kids[c->nkids++] = c->stack[k];
    c->sp = j - 1;
    return 0;
}

static int str_is(const pk *c, const val *v, const char *s)
{
    return v->kind == V_STR && v->len == strlen(s) &&
           memcmp(c->p + v->off, s, v->len) == 0;
}

static int eq(const char *s, size_t n, const char *lit)
{
    return n == strlen(lit) && memcmp(s, lit, n) == 0;
}

/* GLOBAL: two lines of at most 128 ASCII characters, an allowed pair. */
static int line(pk *c, const char **s, size_t *n)
{
    size_t j = c->i;
    while (j < c->n && j - c->i < 128 && c->p[j] != '\n')
        j++;
    if (j >= c->n || c->p[j] != '\n')
        PFAIL("unterminated GLOBAL");
    for (size_t k = c->i; k < j; k++)
        if (c->p[k] >= 0x80)
            PFAIL("non-ASCII GLOBAL");
    *s = (const char *)c->p + c->i;
    *n = j - c->i;
    c->i = j + 1;
    return 0;
}

static int global(pk *c)
{
    const char *mod, *name;
    size_t ml, nl;
    int code = -1, rc;
    if ((rc = line(c, &mod, &ml)) < 0 || (rc = line(c, &name, &nl)) < 0)
        return rc;
    if (eq(mod, ml, "torch._utils") && eq(name, nl, "_rebuild_tensor_v2"))
        code = G_V2;
    else if (eq(mod, ml, "torch._utils") && eq(name, nl, "_rebuild_tensor_v3"))
        code = G_V3;
    else if (eq(mod, ml, "collections") && eq(name, nl, "OrderedDict"))
        code = G_ODICT;
    else if (eq(mod, ml, "torch.storage") && eq(name, nl, "UntypedStorage"))
        code = G_UNTYPED;
    else if (eq(mod, ml, "torch"))
        for (int d = 0; d < ss_zip_ndtypes && code < 0; d++) {
            if (ss_zip_dtypes[d].storage != NULL &&
                eq(name, nl, ss_zip_dtypes[d].storage))
                code = G_STORAGE + d;
            else if (ss_zip_dtypes[d].storage == NULL &&
                     eq(name, nl, ss_zip_dtypes[d].name))
                code = G_DTYPE + d;
        }
    if (code < 0)
        PFAIL("references a global a tensor pickle never uses");
    return push(c, (val){V_GLOBAL, code, 0, 0, 0, 0});
}

/* BINPERSID: ('storage', storage class, key, location, numel). */
static int persid(pk *c)
{
    uint32_t t;
    const val *f[5];
    int rc = pop(c, &t), dt;
    if (rc < 0)
        return rc;
    if (c->v[t].kind != V_TUPLE || c->v[t].len != 5)
        PFAIL("persistent id is not a 5-tuple");
    for (int k = 0; k < 5; k++)
        f[k] = &c->v[c->kids[c->v[t].off + (uint32_t)k]];
    if (!str_is(c, f[0], "storage") || f[1]->kind != V_GLOBAL ||
        f[2]->kind != V_STR || f[3]->kind != V_STR || f[4]->kind != V_INT ||
        f[4]->i < 0)
        PFAIL("persistent id fields have the wrong types");
    if (f[1]->i == G_UNTYPED)
        dt = -1;
    else if (f[1]->i >= G_STORAGE && f[1]->i < G_STORAGE + ss_zip_ndtypes)
        dt = (int)f[1]->i - G_STORAGE;
    else
        PFAIL("persistent id names no storage type");
    if (!str_is(c, f[3], "cpu"))
        PFAIL("storage location is not 'cpu'");
    return push(c, (val){V_STORAGE, f[4]->i, f[2]->off, f[2]->len, dt, 0});
}

/* A tuple of at most 64 non-negative ints into out; its length. */
static int int_tuple(pk *c, const val *v, int64_t *out, int *nd)
{
    if (v->kind != V_TUPLE || v->len > SS_ZIP_MAX_NDIM)
        PFAIL("size or stride is not a tuple of non-negative ints");
    for (uint32_t k = 0; k < v->len; k++) {
        const val *x = &c->v[c->kids[v->off + k]];
        if (x->kind != V_INT || x->i < 0)
            PFAIL("size or stride is not a tuple of non-negative ints");
        out[k] = x->i;
    }
    *nd = (int)v->len;
    return 0;
}

static int reduce(pk *c)
{
    uint32_t ai, fi;
    const val *fn, *args, *a[7];
    int rc, v3, conj = 0, neg = 0, dt, nd, nd2;
    uint32_t nargs;
    ss_zip_tensor *t = c->t;

    if ((rc = pop(c, &ai)) < 0 || (rc = pop(c, &fi)) < 0)
        return rc;
    fn = &c->v[fi];
    args = &c->v[ai];
    if (fn->kind != V_GLOBAL || args->kind != V_TUPLE)
        PFAIL("REDUCE on something other than an allowed global");
    if (fn->i == G_ODICT) {
        if (args->len != 0)
            PFAIL("backward-hooks OrderedDict is not empty");
        return push(c, (val){V_ODICT, 0, 0, 0, 0, 0});
    }
    v3 = fn->i == G_V3;
    if (fn->i != G_V2 && !v3)
        PFAIL("REDUCE calls a global that is not a tensor rebuild");
    nargs = args->len;
    for (uint32_t k = 0; k < nargs && k < 7; k++)
        a[k] = &c->v[c->kids[args->off + k]];
    if (!v3 && nargs == 7 && a[6]->kind == V_DICT) {
        conj = a[6]->a == 1;
        neg = a[6]->b == 1;
        nargs = 6;
    }
    if (nargs != (v3 ? 7u : 6u))
        PFAIL("tensor rebuild called with the wrong number of arguments");
    if (a[0]->kind != V_STORAGE || a[1]->kind != V_INT || a[1]->i < 0)
        PFAIL("tensor rebuild arguments are not (storage, offset, ...)");
    if (a[4]->kind != V_BOOL || a[5]->kind != V_ODICT)
        PFAIL("requires_grad/backward_hooks arguments are malformed");
    if (v3) {
        if (a[0]->a != -1 || a[6]->kind != V_GLOBAL || a[6]->i < G_DTYPE ||
            a[6]->i >= G_DTYPE + ss_zip_ndtypes)
            PFAIL("_rebuild_tensor_v3 needs an UntypedStorage and a dtype");
        dt = (int)a[6]->i - G_DTYPE;
    } else {
        if (a[0]->a == -1)
            PFAIL("_rebuild_tensor_v2 with an UntypedStorage");
        dt = a[0]->a;
    }
    if ((rc = int_tuple(c, a[2], t->shape, &nd)) < 0 ||
        (rc = int_tuple(c, a[3], t->stride, &nd2)) < 0)
        return rc;
    if (nd != nd2)
        PFAIL("size and stride differ in length");
    if (conj && strncmp(ss_zip_dtypes[dt].name, "complex", 7) != 0)
        PFAIL("a conjugate view of a non-complex tensor");
    if (c->have_tensor)
        PFAIL("more than one tensor");
    c->have_tensor = 1;
    t->dtype = ss_zip_dtypes[dt].name;
    t->itemsize = ss_zip_dtypes[dt].itemsize;
    t->ndim = nd;
    t->storage_offset = a[1]->i;
    t->requires_grad = (int)a[4]->i;
    t->conj = conj;
    t->neg = neg;
    /* the storage: its dtype, key and numel, kept in the tensor's value */
    return push(c, (val){V_TENSOR, a[0]->i, a[0]->off, a[0]->len, a[0]->a, 0});
}

/* SETITEM/SETITEMS pairs into the dict below them: "conj"/"neg" -> bool. */
static int set_items(pk *c, const uint32_t *kv, size_t npairs)
{
    val *d = c->sp > 0 ? &c->v[c->stack[c->sp - 1]] : NULL;
    size_t have;
    if (d == NULL || d->kind != V_DICT)
        PFAIL("SETITEM(S) outside a small str->bool metadata dict");
    have = (size_t)(d->a >= 0) + (size_t)(d->b >= 0);
    if (have + npairs > 8)
        PFAIL("metadata dict too large");
    for (size_t k = 0; k < npairs; k++) {
        const val *key = &c->v[kv[2 * k]], *v = &c->v[kv[2 * k + 1]];
        if (v->kind != V_BOOL)
            PFAIL("metadata dict value is not a bool");
        if (str_is(c, key, "conj"))
            d->a = (int)v->i;
        else if (str_is(c, key, "neg"))
            d->b = (int)v->i;
        else
            PFAIL("tensor metadata other than torch's conj/neg bits");
    }
    return 0;
}

static int memo_find(const pk *c, uint32_t key)
{
    for (size_t k = 0; k < c->nmemo; k++)
        if (c->memo_key[k] == key)
            return (int)k;
    return -1;
}

static int op(pk *c, unsigned char o)
{
    const unsigned char *a;
    uint32_t x, y, off, cnt;
    int rc, m;

    switch (o) {
    case 'c':
        return global(c);
    case 'q':
    case 'r':
        if ((rc = take(c, o == 'q' ? 1 : 4, &a)) < 0)
            return rc;
        x = o == 'q' ? a[0] : rd32(a);
        if (c->sp == 0 || c->v[c->stack[c->sp - 1]].kind == V_MARK)
            PFAIL("BINPUT of nothing");
        m = memo_find(c, x);
        if (m < 0) {
            if (c->nmemo == MAX_MEMO)
                PFAIL("too many memo entries");
            m = (int)c->nmemo++;
            c->memo_key[m] = x;
        }
        c->memo_val[m] = c->stack[c->sp - 1];
        return 0;
    case 'h':
    case 'j':
        if ((rc = take(c, o == 'h' ? 1 : 4, &a)) < 0)
            return rc;
        m = memo_find(c, o == 'h' ? a[0] : rd32(a));
        if (m < 0)
            PFAIL("memo key read before it is written");
        return push_ref(c, c->memo_val[m]);
    case '(':
        return push(c, (val){V_MARK, 0, 0, 0, 0, 0});
    case ')':
        return push(c, (val){V_TUPLE, 0, 0, 0, 0, 0});
    case 't':
        if ((rc = pop_mark(c, &off, &cnt)) < 0)
            return rc;
        return push(c, (val){V_TUPLE, 0, off, cnt, 0, 0});
    case 0x85:
    case 0x86:
    case 0x87:
        cnt = (uint32_t)(o - 0x84);
        if (cnt > MAX_KIDS - c->nkids)
            PFAIL("too many tuple items");
        off = (uint32_t)c->nkids;
        for (uint32_t k = cnt; k > 0; k--)
            if ((rc = pop(c, &c->kids[off + k - 1])) < 0)
                return rc;
        c->nkids += cnt;
        return push(c, (val){V_TUPLE, 0, off, cnt, 0, 0});
    case 'X':
        if ((rc = take(c, 4, &a)) < 0)
            return rc;
        x = rd32(a);
        if (x > 256)
            PFAIL("overlong string");
        if ((rc = take(c, x, &a)) < 0)
            return rc;
        for (uint32_t k = 0; k < x; k++)
            if (a[k] >= 0x80)
                PFAIL("non-ASCII string");
        return push(c, (val){V_STR, 0, (uint32_t)(a - c->p), x, 0, 0});
    case 'K':
        if ((rc = take(c, 1, &a)) < 0)
            return rc;
        return push(c, (val){V_INT, a[0], 0, 0, 0, 0});
    case 'M':
        if ((rc = take(c, 2, &a)) < 0)
            return rc;
        return push(c, (val){V_INT, rd16(a), 0, 0, 0, 0});
    case 'J':
        if ((rc = take(c, 4, &a)) < 0)
            return rc;
        return push(c, (val){V_INT, (int32_t)rd32(a), 0, 0, 0, 0});
    case 0x8a: {
        uint64_t u = 0;
        if ((rc = take(c, 1, &a)) < 0)
            return rc;
        x = a[0];
        if (x > 8)
            PFAIL("integer over 64 bits");
        if ((rc = take(c, x, &a)) < 0)
            return rc;
        for (uint32_t k = 0; k < x; k++)
            u |= (uint64_t)a[k] << (8 * k);
        if (x > 0 && x < 8 && (a[x - 1] & 0x80))
            u |= ~(uint64_t)0 << (8 * x); /* sign-extend */
        return push(c, (val){V_INT, (int64_t)u, 0, 0, 0, 0});
    }
    case 0x88:
    case 0x89:
        return push(c, (val){V_BOOL, o == 0x88, 0, 0, 0, 0});
    case '}':
        return push(c, (val){V_DICT, 0, 0, 0, -1, -1});
    case 's':
        if ((rc = pop(c, &y)) < 0 || (rc = pop(c, &x)) < 0)
            return rc;
        {
            uint32_t kv[2] = {x, y};
            return set_items(c, kv, 1);
        }
    case 'u':
        if ((rc = pop_mark(c, &off, &cnt)) < 0)
            return rc;
        if (cnt % 2)
            PFAIL("SETITEMS with an odd number of items");
        return set_items(c, c->kids + off, cnt / 2);
    case 'Q':
        return persid(c);
    case 'R':
        return reduce(c);
    default:
        PFAIL("opcode not used by tensor pickles");
    }
}

/* Runs data.pkl; on success t holds the tensor and *st its storage. */
static int walk(const unsigned char *p, size_t n, ss_zip_tensor *t, val *st,
                ss_errinfo *err)
{
    pk *c = calloc(1, sizeof *c);
    int rc = 0;
    if (c == NULL)
        return ss_errinfo_set(err, SS_ENOMEM, "malloc", NULL, -1, NULL);
    c->p = p;
    c->n = n;
    c->t = t;
    c->err = err;
    c->v = malloc(SS_ZIP_MAX_VALUES * sizeof *c->v);
    c->kids = malloc(MAX_KIDS * sizeof *c->kids);
    if (c->v == NULL || c->kids == NULL) {
        rc = ss_errinfo_set(err, SS_ENOMEM, "malloc", NULL, -1, NULL);
        goto out;
    }
    if (n > SS_ZIP_MAX_PICKLE) {
        rc = refuse(err, "data.pkl over the C parser's size limit", n);
        goto out;
    }
    if (n < 2 || p[0] != 0x80 || p[1] != 2) {
        rc = refuse(err, "data.pkl is not protocol 2", 0);
        goto out;
    }
    c->i = 2;
    for (;;) {
        const unsigned char *o;
        if (c->sp > MAX_STACK) {
            rc = refuse(err, "data.pkl stack too deep", c->i);
            goto out;
        }
        if ((rc = take(c, 1, &o)) < 0)
            goto out;
        if (*o == '.') {
            if (c->i != n || c->sp != 1 || c->v[c->stack[0]].kind != V_TENSOR) {
                rc = refuse(err,
                            "data.pkl does not end with one tensor and STOP",
                            c->i);
                goto out;
            }
            *st = c->v[c->stack[0]];
            break;
        }
        if ((rc = op(c, *o)) < 0)
            goto out;
    }
out:
    free(c->v);
    free(c->kids);
    free(c);
    return rc;
}

/* ---- the record ---------------------------------------------------------- */

static const entry *find(const entry *e, size_t n, const char *name,
                         size_t nlen)
{
    for (size_t k = 0; k < n; k++)
        if (e[k].nlen == nlen && memcmp(e[k].name, name, nlen) == 0)
            return &e[k];
    return NULL;
}
#define FIND(lit) find(ents, nents, (lit), sizeof(lit) - 1)

static int is_space(unsigned char ch)
{
    return ch == ' ' || (ch >= '\t' && ch <= '\r');
}

int ss_zipread_tensor(const void *buf, size_t len, ss_zip_tensor *out,
                      ss_errinfo *err)
{
    const unsigned char *b = buf;
    entry ents[SS_ZIP_MAX_ENTRIES];
    const entry *pk_e, *bo, *ver, *data;
    size_t nents = 0, vs, ve;
    char key[5 + 256];
    int any_crc = 0, rc;
    val st = {0};
    uint64_t nbytes, ver_n = 0;

    memset(out, 0, sizeof *out);
    if ((rc = parse_zip(b, len, ents, &nents, err)) < 0)
        return rc;
    pk_e = FIND("data.pkl");
    if (pk_e == NULL)
        FAIL("no data.pkl entry", 0);
    for (size_t k = 0; k < nents; k++)
        any_crc |= ents[k].crc != 0;
    for (size_t k = 0; any_crc && k < nents; k++)
        if (!(ents[k].nlen >= 5 && memcmp(ents[k].name, "data/", 5) == 0) &&
            ss_crc32(0, b + ents[k].data, ents[k].size) != ents[k].crc)
            FAIL("entry does not match its CRC-32", ents[k].header);
    bo = FIND("byteorder");
    if (bo != NULL && (bo->size != 6 || memcmp(b + bo->data, "little", 6)))
        FAIL("byteorder is not little", bo->header);
    ver = FIND("version");
    if (ver == NULL)
        ver = FIND(".data/version");
    if (ver == NULL || ver->size > 64)
        FAIL("missing or bad version entry", 0);
    vs = 0;
    ve = (size_t)ver->size;
    while (vs < ve && is_space(b[ver->data + vs]))
        vs++;
    while (ve > vs && is_space(b[ver->data + ve - 1]))
        ve--;
    for (size_t k = vs; k < ve; k++) {
        unsigned char ch = b[ver->data + k];
        if (ch < '0' || ch > '9')
            FAIL("version is not a number", ver->header);
        ver_n = ver_n > 100 ? ver_n : ver_n * 10 + (ch - '0');
    }
    if (vs == ve || ver_n < 1 || ver_n > 20)
        FAIL("version outside 1..20", ver->header);
    if ((rc = walk(b + pk_e->data, (size_t)pk_e->size, out, &st, err)) < 0)
        return rc;
    memcpy(key, "data/", 5);
    memcpy(key + 5, b + pk_e->data + st.off, st.len);
    data = find(ents, nents, key, 5 + st.len);
    if (data == NULL)
        FAIL("data.pkl names a storage with no data entry", 0);
    if (st.a >= 0) {
        if (__builtin_mul_overflow((uint64_t)st.i, out->itemsize, &nbytes))
            FAIL("storage size overflows", data->header);
    } else {
        nbytes = (uint64_t)st.i;
    }
    if (data->size != nbytes || nbytes % out->itemsize)
        FAIL("storage entry size differs from data.pkl's", data->header);
    out->storage_numel = (int64_t)(nbytes / out->itemsize);
    {
        int empty = 0;
        int64_t span = out->storage_offset;
        for (int d = 0; d < out->ndim; d++)
            empty |= out->shape[d] == 0;
        if (!empty) {
            for (int d = 0; d < out->ndim; d++) {
                int64_t t;
                if (__builtin_mul_overflow(out->shape[d] - 1, out->stride[d],
                                           &t) ||
                    __builtin_add_overflow(span, t, &span))
                    FAIL("size and stride overflow", 0);
            }
            if (span >= out->storage_numel)
                FAIL("size, stride and offset overrun the storage", 0);
        } else if (out->storage_offset > out->storage_numel) {
            FAIL("storage offset past the storage", 0);
        }
    }
    out->data_offset = data->data;
    out->data_length = data->size;
    out->data_crc32 = data->crc;
    out->has_crc = any_crc;
    return 0;
}
