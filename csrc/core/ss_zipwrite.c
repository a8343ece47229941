/* ss_zipwrite.c - a tensor record's header, trailer template and patch.
 *
 * A port of _zipfmt.py's writer half (_tensor_pickle, _assemble and the
 * zip pieces it calls), laid out in one pass: the records before data/0's
 * bytes go into the header, everything after into the trailer, and the
 * central directory (built alongside) is appended to the trailer with the
 * end records. While laying out, the five CRC-dependent positions of the
 * trailer are noted, and the id's CRC hash is kept as the hash of the CRCs
 * before data/0's plus the CRCs after it (version's), so a patch is a
 * handful of stores, one hash_combine chain and a 40-byte CRC.
 */
#include "ss_zipwrite.h"
#include "ss_crc.h"
#include "ss_zipdtype.h"

#include <stdlib.h>
#include <string.h>

#define U32MAX 0xFFFFFFFFull
#define ALIGN 64

struct ss_zip_plan {
    uint8_t *header, *trailer;
    size_t header_len, trailer_len;
    uint64_t data_len;
    /* trailer offsets of the CRC-dependent fields (data_len > 0 only) */
    size_t desc_crc, cd_data_crc, sid, sid_desc_crc, cd_sid_crc;
    uint64_t hc_before; /* hash of the CRCs before data/0's */
    uint32_t after[4];  /* the CRCs hashed after data/0's */
    size_t nafter;
};

/* ---- a growable byte buffer ---------------------------------------------- */

typedef struct {
    uint8_t *p;
    size_t n, cap;
    int err;
} buf;

static void put(buf *b, const void *src, size_t n)
{
    if (b->err)
        return;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n)
            cap *= 2;
        uint8_t *p = realloc(b->p, cap);
        if (p == NULL) {
            b->err = SS_ENOMEM;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}

static void put8(buf *b, unsigned v)
{
    uint8_t c = (uint8_t)v;
    put(b, &c, 1);
}

static void put16(buf *b, uint64_t v)
{
    uint8_t c[2] = {(uint8_t)v, (uint8_t)(v >> 8)};
    put(b, c, 2);
}

static void put32(buf *b, uint64_t v)
{
    uint8_t c[4];
    for (int i = 0; i < 4; i++)
        c[i] = (uint8_t)(v >> (8 * i));
    put(b, c, 4);
}

static void put64(buf *b, uint64_t v)
{
    uint8_t c[8];
    for (int i = 0; i < 8; i++)
        c[i] = (uint8_t)(v >> (8 * i));
    put(b, c, 8);
}

static void puts_(buf *b, const char *s)
{
    put(b, s, strlen(s));
}

static void store32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* ---- dtypes ------------------------------------------------------------- */

typedef ss_zip_dtype dtype;

static const dtype *find_dtype(const char *name)
{
    if (strncmp(name, "torch.", 6) == 0)
        name += 6;
    return ss_zip_dtype_find(name);
}

/* ---- data.pkl: the protocol-2 pickle torch.save writes for a tensor ------ */

typedef struct {
    buf *b;
    unsigned memo;
} pickler;

static void pk_put(pickler *p)
{
    put8(p->b, 'q'); /* BINPUT: fewer than 256 memo entries ever occur */
    put8(p->b, p->memo++);
}

static void pk_int(pickler *p, int64_t v)
{
    if (v <= 0xFF) {
        put8(p->b, 'K');
        put8(p->b, (unsigned)v);
    } else if (v <= 0xFFFF) {
        put8(p->b, 'M');
        put16(p->b, (uint64_t)v);
    } else if (v <= 0x7FFFFFFF) {
        put8(p->b, 'J');
        put32(p->b, (uint64_t)v);
    } else { /* LONG1: minimal two's complement, little-endian */
        int bits = 0;
        for (uint64_t u = (uint64_t)v; u; u >>= 1)
            bits++;
        int n = (bits >> 3) + 1;
        put8(p->b, 0x8a);
        put8(p->b, (unsigned)n);
        for (int i = 0; i < n; i++)
            put8(p->b, i < 8 ? (unsigned)((uint64_t)v >> (8 * i)) & 0xFF : 0);
    }
}

static void pk_str(pickler *p, const char *s)
{
    put8(p->b, 'X');
    put32(p->b, strlen(s));
    puts_(p->b, s);
    pk_put(p);
}

static void pk_glob(pickler *p, const char *mod, const char *name)
{
    put8(p->b, 'c');
    puts_(p->b, mod);
    put8(p->b, '\n');
    puts_(p->b, name);
    put8(p->b, '\n');
    pk_put(p);
}

static void pk_tuple(pickler *p, const int64_t *v, size_t n)
{
    if (n == 0) {
        put8(p->b, ')');
        return;
    }
    if (n > 3)
        put8(p->b, '(');
    for (size_t i = 0; i < n; i++)
        pk_int(p, v[i]);
    put8(p->b, n > 3 ? 't' : (unsigned)(0x85 + n - 1));
    pk_put(p);
}

static void tensor_pickle(buf *b, const dtype *dt, int64_t numel, size_t ndim,
                          const int64_t *shape, const int64_t *stride)
{
    pickler p = {b, 0};
    put8(b, 0x80);
    put8(b, 2);
    if (dt->storage != NULL)
        pk_glob(&p, "torch._utils", "_rebuild_tensor_v2");
    else
        pk_glob(&p, "torch._utils", "_rebuild_tensor_v3");
    puts_(b, "((");
    pk_str(&p, "storage");
    if (dt->storage != NULL) {
        pk_glob(&p, "torch", dt->storage);
    } else {
        pk_glob(&p, "torch.storage", "UntypedStorage");
        numel *= dt->itemsize; /* untyped storage: counted in bytes */
    }
    pk_str(&p, "0");
    pk_str(&p, "cpu");
    pk_int(&p, numel);
    put8(b, 't');
    pk_put(&p);
    put8(b, 'Q'); /* BINPERSID */
    pk_int(&p, 0);
    pk_tuple(&p, shape, ndim);
    pk_tuple(&p, stride, ndim);
    put8(b, 0x89); /* requires_grad=False */
    pk_glob(&p, "collections", "OrderedDict");
    puts_(b, ")R");
    pk_put(&p);
    if (dt->storage == NULL)
        pk_glob(&p, "torch", dt->name);
    put8(b, 't');
    pk_put(&p);
    put8(b, 'R');
    pk_put(&p);
    put8(b, '.');
}

/* ---- hashes -------------------------------------------------------------- */

uint64_t ss_zip_std_hash(const void *data, size_t len)
{
    const uint64_t mul = (0xC6A4A793ull << 32) + 0x5BD1E995ull;
    const uint8_t *s = data;
    uint64_t h = 0xC70F6907ull ^ ((uint64_t)len * mul);
    size_t end = len & ~(size_t)7;

    for (size_t i = 0; i < end; i += 8) {
        uint64_t d = 0;
        for (int k = 7; k >= 0; k--)
            d = (d << 8) | s[i + (size_t)k];
        d *= mul;
        d = (d ^ (d >> 47)) * mul;
        h = (h ^ d) * mul;
    }
    if (len & 7) {
        uint64_t d = 0;
        for (size_t k = len; k > end; k--)
            d = (d << 8) | s[k - 1];
        h = (h ^ d) * mul;
    }
    h = (h ^ (h >> 47)) * mul;
    return h ^ (h >> 47);
}

uint64_t ss_zip_hash_combine(uint64_t seed, uint64_t v)
{
    return seed ^ (v + 0x9E3779B9ull + (seed << 6) + (seed >> 2));
}

/* 20 decimal digits of v, zero-padded (no terminator). */
static void digits20(uint8_t *out, uint64_t v)
{
    for (int i = 19; i >= 0; i--) {
        out[i] = (uint8_t)('0' + v % 10);
        v /= 10;
    }
}

/* ---- the zip container, as PyTorchStreamWriter + miniz write it ---------- */

#define NREC 7 /* data.pkl, 3 small ones, data/0, version, serialization_id */

typedef struct {
    buf head, tail, cd;
    buf *into; /* head until data/0's bytes, then tail */
    uint64_t cursor;
    const char *names[NREC];
    size_t nnames;
    uint32_t crcs[NREC];
    size_t ncrcs;
    ss_zip_plan *plan;
} layout;

static void zip64_extra(buf *b, int has_size, uint64_t size, int has_comp,
                        uint64_t comp, int has_ofs, uint64_t ofs)
{
    size_t body = 8u * (size_t)(has_size + has_comp + has_ofs);
    if (body == 0)
        return;
    put16(b, 1);
    put16(b, body);
    if (has_size)
        put64(b, size);
    if (has_comp)
        put64(b, comp);
    if (has_ofs)
        put64(b, ofs);
}

/* Add record name: its bytes, or (payload NULL) size streamed bytes. */
static void add(layout *L, const char *name, const uint8_t *payload,
                uint64_t size)
{
    char full[64] = "archive/";
    size_t nlen;
    int big = size >= U32MAX, far = L->cursor >= U32MAX;
    uint32_t crc = payload != NULL ? ss_crc32(0, payload, (size_t)size) : 0;
    uint8_t z64[28];
    buf zb = {z64, 0, sizeof z64, 0};
    buf *b = L->into;
    size_t start = b->n;
    unsigned flags = size ? 0x0808 : 0x0800;

    strncat(full, name, sizeof full - 9);
    nlen = strlen(full);
    /* local header: miniz writes comp=0 in a big record's local extra */
    zip64_extra(&zb, big, size, big, 0, far, L->cursor);
    uint64_t dstart = L->cursor + 30 + nlen + zb.n + 4;
    size_t pad = (size_t)((ALIGN - dstart % ALIGN) % ALIGN);
    put32(b, 0x04034B50);
    put16(b, 0);
    put16(b, flags);
    put16(b, 0);
    put16(b, 0);
    put16(b, 0);
    put32(b, 0);
    put32(b, 0);
    put32(b, 0);
    put16(b, nlen);
    put16(b, zb.n + 4 + pad);
    put(b, full, nlen);
    put(b, z64, zb.n);
    puts_(b, "FB");
    put16(b, pad);
    for (size_t i = 0; i < pad; i++)
        put8(b, 'Z');
    size_t hlen = b->n - start;
    if (payload == NULL) { /* the streamed bytes come between */
        L->into = b = &L->tail;
        if (size)
            L->plan->desc_crc = b->n + 4;
    } else {
        if (strcmp(name, ".data/serialization_id") == 0)
            L->plan->sid = b->n;
        put(b, payload, (size_t)size);
    }
    if (size) { /* the data descriptor */
        if (payload != NULL && strcmp(name, ".data/serialization_id") == 0)
            L->plan->sid_desc_crc = b->n + 4;
        put32(b, 0x08074B50);
        put32(b, crc);
        if (zb.n) {
            put64(b, size);
            put64(b, size);
        } else {
            put32(b, size);
            put32(b, size);
        }
    }
    /* its central directory entry */
    int cbig = size >= U32MAX;
    uint8_t cz[28];
    buf czb = {cz, 0, sizeof cz, 0};
    zip64_extra(&czb, cbig, size, cbig, size, far, L->cursor);
    if (payload == NULL)
        L->plan->cd_data_crc = L->cd.n + 16;
    else if (strcmp(name, ".data/serialization_id") == 0)
        L->plan->cd_sid_crc = L->cd.n + 16;
    put32(&L->cd, 0x02014B50);
    put16(&L->cd, 0);
    put16(&L->cd, 0);
    put16(&L->cd, flags);
    put16(&L->cd, 0);
    put16(&L->cd, 0);
    put16(&L->cd, 0);
    put32(&L->cd, crc);
    put32(&L->cd, size < U32MAX ? size : U32MAX);
    put32(&L->cd, size < U32MAX ? size : U32MAX);
    put16(&L->cd, nlen);
    put16(&L->cd, czb.n);
    put16(&L->cd, 0);
    put16(&L->cd, 0);
    put16(&L->cd, 0);
    put32(&L->cd, 0);
    put32(&L->cd, L->cursor < U32MAX ? L->cursor : U32MAX);
    put(&L->cd, full, nlen);
    put(&L->cd, cz, czb.n);
    L->cursor += hlen + size + (size ? (zb.n ? 24 : 16) : 0);
    L->names[L->nnames++] = name;
    if (size) /* torch hashes the CRCs it sees in data descriptors */
        L->crcs[L->ncrcs++] = crc;
}

int ss_zip_plan_new(const char *dtype_name, size_t ndim, const int64_t *shape,
                    const int64_t *stride, int64_t storage_numel,
                    ss_zip_plan **out)
{
    const dtype *dt = dtype_name != NULL ? find_dtype(dtype_name) : NULL;
    int64_t cstride[SS_ZIP_MAX_NDIM];
    uint64_t span = 1;
    layout L = {0};
    buf pkl = {0};
    uint8_t sid[40];
    int rc = 0;

    *out = NULL;
    if (dt == NULL || ndim > SS_ZIP_MAX_NDIM || (ndim > 0 && shape == NULL))
        return SS_EINVAL;
    if (stride == NULL) { /* a zero-size dimension counts as 1, as torch's */
        uint64_t s = 1;
        for (size_t i = ndim; i-- > 0;) {
            uint64_t n = shape[i] > 0 ? (uint64_t)shape[i] : 1;
            if (shape[i] < 0 || n > ((uint64_t)INT64_MAX / 16) / s)
                return SS_EINVAL;
            cstride[i] = (int64_t)s;
            s *= n;
        }
        stride = cstride;
    }
    for (size_t i = 0; i < ndim; i++) {
        if (shape[i] < 0 || stride[i] < 0)
            return SS_EINVAL;
        if (shape[i] == 0)
            span = 0;
    }
    for (size_t i = 0; span && i < ndim; i++) {
        uint64_t reach = (uint64_t)(shape[i] - 1) * (uint64_t)stride[i];
        if (shape[i] > 1 &&
            reach / (uint64_t)(shape[i] - 1) != (uint64_t)stride[i])
            return SS_EINVAL;
        span += reach;
        if (span > (uint64_t)INT64_MAX / 16)
            return SS_EINVAL;
    }
    if (storage_numel < 0)
        storage_numel = (int64_t)span;
    if ((uint64_t)storage_numel < span ||
        (uint64_t)storage_numel > (uint64_t)INT64_MAX / 16)
        return SS_EINVAL;

    L.plan = calloc(1, sizeof *L.plan);
    if (L.plan == NULL)
        return SS_ENOMEM;
    L.into = &L.head;
    L.plan->data_len = (uint64_t)storage_numel * (uint64_t)dt->itemsize;
    tensor_pickle(&pkl, dt, storage_numel, ndim, shape, stride);
    if (pkl.err) {
        rc = pkl.err;
        goto out;
    }
    add(&L, "data.pkl", pkl.p, pkl.n);
    add(&L, ".format_version", (const uint8_t *)"1", 1);
    add(&L, ".storage_alignment", (const uint8_t *)"64", 2);
    add(&L, "byteorder", (const uint8_t *)"little", 6);
    uint64_t hc = 0;
    for (size_t i = 0; i < L.ncrcs; i++)
        hc = ss_zip_hash_combine(hc, L.crcs[i]);
    L.plan->hc_before = hc;
    add(&L, "data/0", NULL, L.plan->data_len);
    size_t data_at = L.ncrcs; /* data/0's CRC, if it has one, is next */
    add(&L, "version", (const uint8_t *)"3\n", 2);
    for (size_t i = data_at; i < L.ncrcs; i++)
        L.plan->after[L.plan->nafter++] = L.crcs[i];
    /* the id: the names hashed in reverse insertion order (torch's
     * unordered_set iteration order for these sets), then the CRCs */
    uint64_t hn = 0;
    for (size_t i = L.nnames; i-- > 0;) /* without the folder */
        hn = ss_zip_hash_combine(
            hn, ss_zip_std_hash(L.names[i], strlen(L.names[i])));
    hc = 0;
    for (size_t i = 0; i < L.ncrcs; i++)
        hc = ss_zip_hash_combine(hc, L.crcs[i]);
    digits20(sid, hn);
    digits20(sid + 20, hc);
    add(&L, ".data/serialization_id", sid, sizeof sid);
    /* the central directory and the end records */
    uint64_t cd_ofs = L.cursor, cd_size = L.cd.n, n = L.nnames;
    size_t cd_at = L.tail.n;
    put(&L.tail, L.cd.p, L.cd.n);
    put32(&L.tail, 0x06064B50);
    put64(&L.tail, 44);
    put16(&L.tail, 0x031E);
    put16(&L.tail, 0x002D);
    put32(&L.tail, 0);
    put32(&L.tail, 0);
    put64(&L.tail, n);
    put64(&L.tail, n);
    put64(&L.tail, cd_size);
    put64(&L.tail, cd_ofs);
    put32(&L.tail, 0x07064B50);
    put32(&L.tail, 0);
    put64(&L.tail, cd_ofs + cd_size);
    put32(&L.tail, 1);
    put32(&L.tail, 0x06054B50);
    put16(&L.tail, 0);
    put16(&L.tail, 0);
    put16(&L.tail, n);
    put16(&L.tail, n);
    put32(&L.tail, cd_size < U32MAX ? cd_size : U32MAX);
    put32(&L.tail, cd_ofs < U32MAX ? cd_ofs : U32MAX);
    put16(&L.tail, 0);
    rc = L.head.err ? L.head.err : L.tail.err ? L.tail.err : L.cd.err;
    if (rc < 0)
        goto out;
    L.plan->cd_data_crc += cd_at;
    L.plan->cd_sid_crc += cd_at;
    L.plan->header = L.head.p;
    L.plan->header_len = L.head.n;
    L.plan->trailer = L.tail.p;
    L.plan->trailer_len = L.tail.n;
    L.head.p = L.tail.p = NULL;
    *out = L.plan;
    L.plan = NULL;
out:
    free(L.head.p);
    free(L.tail.p);
    free(L.cd.p);
    free(pkl.p);
    free(L.plan);
    return rc;
}

void ss_zip_plan_free(ss_zip_plan *plan)
{
    if (plan == NULL)
        return;
    free(plan->header);
    free(plan->trailer);
    free(plan);
}

const uint8_t *ss_zip_plan_header(const ss_zip_plan *plan, size_t *len)
{
    *len = plan->header_len;
    return plan->header;
}

uint64_t ss_zip_plan_data_length(const ss_zip_plan *plan)
{
    return plan->data_len;
}

const uint8_t *ss_zip_plan_trailer(const ss_zip_plan *plan, size_t *len)
{
    *len = plan->trailer_len;
    return plan->trailer;
}

uint64_t ss_zip_plan_total_length(const ss_zip_plan *plan)
{
    return plan->header_len + plan->data_len + plan->trailer_len;
}

void ss_zip_plan_patch(const ss_zip_plan *plan, uint8_t *t, uint32_t crc)
{
    if (plan->data_len == 0) /* no descriptor, no CRC in the id */
        return;
    uint64_t hc = ss_zip_hash_combine(plan->hc_before, crc);
    for (size_t i = 0; i < plan->nafter; i++)
        hc = ss_zip_hash_combine(hc, plan->after[i]);
    store32(t + plan->desc_crc, crc);
    store32(t + plan->cd_data_crc, crc);
    digits20(t + plan->sid + 20, hc);
    uint32_t sc = ss_crc32(0, t + plan->sid, 40);
    store32(t + plan->sid_desc_crc, sc);
    store32(t + plan->cd_sid_crc, sc);
}
