/* ss_pkwrite.c - protocol-4 pickle emitter and identity memo (see
 * ss_pkwrite.h for the rules followed, after CPython's Modules/_pickle.c).
 * Invariants: frame_start is SIZE_MAX or the offset of the open frame's
 * reserved 9-byte header; len <= cap; after an error nothing is written.
 * No global state; one thread per instance. */
#include "ss_pkwrite.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

#define OP_PROTO 0x80
#define OP_FRAME 0x95
#define OP_MEMOIZE 0x94
#define OP_BINGET 'h'
#define OP_LONG_BINGET 'j'
#define OP_BININT 'J'
#define OP_BININT1 'K'
#define OP_BININT2 'M'
#define OP_LONG1 0x8a
#define OP_BINFLOAT 'G'
#define OP_SHORT_BINUNICODE 0x8c
#define OP_BINUNICODE 'X'
#define OP_BINUNICODE8 0x8d
#define OP_SHORT_BINBYTES 'C'
#define OP_BINBYTES 'B'
#define OP_BINBYTES8 0x8e

/* CPython's FRAME_SIZE_MIN: a shorter frame is written without a header. */
#define FRAME_MIN 4

static int fail(ss_pkw *w, int code, const char *fmt)
{
    if (w->rc == 0)
        w->rc = ss_errinfo_set(&w->err, code, "pickle write", NULL,
                               (int64_t)w->len, "%s", fmt);
    return w->rc;
}

int ss_pkw_init(ss_pkw *w, size_t cap_hint)
{
    memset(w, 0, sizeof(*w));
    ss_errinfo_clear(&w->err);
    w->frame_start = SIZE_MAX;
    w->cap = cap_hint < 256 ? 256 : cap_hint;
    w->buf = malloc(w->cap);
    if (w->buf == NULL) {
        w->cap = 0;
        return fail(w, SS_ENOMEM, "output buffer");
    }
    return 0;
}

void ss_pkw_destroy(ss_pkw *w)
{
    if (w == NULL)
        return;
    free(w->buf);
    w->buf = NULL;
    w->len = w->cap = 0;
}

static int reserve(ss_pkw *w, size_t n)
{
    if (n <= w->cap - w->len)
        return 0;
    if (n > SIZE_MAX / 2 - w->len)
        return fail(w, SS_ENOMEM, "output larger than memory");
    size_t cap = w->cap ? w->cap : 256;
    while (cap - w->len < n)
        cap *= 2;
    unsigned char *p = realloc(w->buf, cap);
    if (p == NULL)
        return fail(w, SS_ENOMEM, "output buffer");
    w->buf = p;
    w->cap = cap;
    return 0;
}

static void put_le(unsigned char *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

int ss_pkw_raw(ss_pkw *w, const void *p, size_t n)
{
    if (w->rc)
        return w->rc;
    int open = w->framing && w->frame_start == SIZE_MAX;
    if (n > SIZE_MAX - SS_PKW_FRAME_HEADER)
        return fail(w, SS_ENOMEM, "output larger than memory");
    if (reserve(w, n + (open ? SS_PKW_FRAME_HEADER : 0)) < 0)
        return w->rc;
    if (open) {
        w->frame_start = w->len;
        memset(w->buf + w->len, 0xfe, SS_PKW_FRAME_HEADER);
        w->len += SS_PKW_FRAME_HEADER;
    }
    if (n)
        memcpy(w->buf + w->len, p, n);
    w->len += n;
    return 0;
}

static void commit(ss_pkw *w)
{
    if (!w->framing || w->frame_start == SIZE_MAX)
        return;
    size_t flen = w->len - w->frame_start - SS_PKW_FRAME_HEADER;
    unsigned char *q = w->buf + w->frame_start;
    if (flen >= FRAME_MIN) {
        q[0] = OP_FRAME;
        put_le(q + 1, flen, 8);
    } else {
        memmove(q, q + SS_PKW_FRAME_HEADER, flen);
        w->len -= SS_PKW_FRAME_HEADER;
    }
    w->frame_start = SIZE_MAX;
}

int ss_pkw_start(ss_pkw *w)
{
    static const unsigned char proto[2] = {OP_PROTO, 4};
    assert(w->len == 0 || w->rc);
    if (ss_pkw_raw(w, proto, 2) < 0)
        return w->rc;
    w->framing = 1;
    return 0;
}

int ss_pkw_boundary(ss_pkw *w)
{
    if (w->rc)
        return w->rc;
    if (w->framing && w->frame_start != SIZE_MAX &&
        w->len - w->frame_start - SS_PKW_FRAME_HEADER >= SS_PKW_FRAME_TARGET)
        commit(w);
    return 0;
}

int ss_pkw_int(ss_pkw *w, int64_t v)
{
    unsigned char b[12];
    if (v >= INT32_MIN && v <= INT32_MAX) {
        put_le(b + 1, (uint64_t)v, 4);
        if (b[4] || b[3]) {
            b[0] = OP_BININT;
            return ss_pkw_raw(w, b, 5);
        }
        if (b[2]) {
            b[0] = OP_BININT2;
            return ss_pkw_raw(w, b, 3);
        }
        b[0] = OP_BININT1;
        return ss_pkw_raw(w, b, 2);
    }
    /* LONG1: as _PyLong_AsByteArray gives it, (bits of |v|) / 8 + 1 bytes
     * of little-endian two's complement, one redundant 0xff dropped. */
    uint64_t mag = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    int nbits = 0;
    while (nbits < 64 && (mag >> nbits))
        nbits++;
    int nbytes = nbits / 8 + 1;
    for (int i = 0; i < nbytes; i++)
        b[2 + i] = i < 8 ? (unsigned char)((uint64_t)v >> (8 * i))
                         : (unsigned char)(v < 0 ? 0xff : 0);
    if (v < 0 && nbytes > 1 && b[2 + nbytes - 1] == 0xff &&
        (b[2 + nbytes - 2] & 0x80))
        nbytes--;
    b[0] = OP_LONG1;
    b[1] = (unsigned char)nbytes;
    return ss_pkw_raw(w, b, 2 + (size_t)nbytes);
}

int ss_pkw_float(ss_pkw *w, double v)
{
    unsigned char b[9];
    uint64_t u;
    memcpy(&u, &v, 8);
    b[0] = OP_BINFLOAT;
    for (int i = 0; i < 8; i++)
        b[1 + i] = (unsigned char)(u >> (8 * (7 - i)));
    return ss_pkw_raw(w, b, 9);
}

/* _Pickler_write_bytes: a payload of the frame target or more commits the
 * open frame and goes out unframed, header included. */
static int payload(ss_pkw *w, const unsigned char *hdr, size_t hn,
                   const void *p, size_t n)
{
    int framing = w->framing;
    if (w->rc)
        return w->rc;
    if (n >= SS_PKW_FRAME_TARGET) {
        commit(w);
        w->framing = 0;
    }
    ss_pkw_raw(w, hdr, hn);
    ss_pkw_raw(w, p, n);
    w->framing = framing;
    return w->rc;
}

static int sized(ss_pkw *w, const void *p, size_t n, unsigned char op_short,
                 unsigned char op4, unsigned char op8)
{
    unsigned char h[9];
    if (n <= 0xff) {
        h[0] = op_short;
        h[1] = (unsigned char)n;
        return payload(w, h, 2, p, n);
    }
    if ((uint64_t)n <= 0xffffffffu) {
        h[0] = op4;
        put_le(h + 1, n, 4);
        return payload(w, h, 5, p, n);
    }
    h[0] = op8;
    put_le(h + 1, n, 8);
    return payload(w, h, 9, p, n);
}

int ss_pkw_str(ss_pkw *w, const char *utf8, size_t n)
{
    return sized(w, utf8, n, OP_SHORT_BINUNICODE, OP_BINUNICODE,
                 OP_BINUNICODE8);
}

int ss_pkw_bytes(ss_pkw *w, const void *p, size_t n)
{
    return sized(w, p, n, OP_SHORT_BINBYTES, OP_BINBYTES, OP_BINBYTES8);
}

int ss_pkw_memoize(ss_pkw *w, uint32_t *index)
{
    if (w->rc)
        return w->rc;
    if (w->memo_n > UINT32_MAX)
        return fail(w, SS_ERANGE, "more than 2^32 memo entries");
    if (index)
        *index = (uint32_t)w->memo_n;
    w->memo_n++;
    return ss_pkw_op(w, OP_MEMOIZE);
}

int ss_pkw_get(ss_pkw *w, uint32_t index)
{
    unsigned char b[5];
    if (w->rc)
        return w->rc;
    if (index >= w->memo_n)
        return fail(w, SS_EINVAL, "BINGET of an entry not memoized");
    if (index < 256) {
        b[0] = OP_BINGET;
        b[1] = (unsigned char)index;
        return ss_pkw_raw(w, b, 2);
    }
    b[0] = OP_LONG_BINGET;
    put_le(b + 1, index, 4);
    return ss_pkw_raw(w, b, 5);
}

int ss_pkw_finish(ss_pkw *w)
{
    if (ss_pkw_op(w, SS_PK_STOP) < 0)
        return w->rc;
    commit(w);
    return 0;
}

/* ---- identity memo ---- */

static size_t slot_of(uintptr_t key, size_t mask)
{
    uint64_t h = (uint64_t)key;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    return (size_t)h & mask;
}

static int alloc_table(ss_pkmemo *m, size_t slots)
{
    m->keys = calloc(slots, sizeof(*m->keys));
    m->vals = malloc(slots * sizeof(*m->vals));
    if (m->keys == NULL || m->vals == NULL) {
        free(m->keys);
        free(m->vals);
        m->keys = NULL;
        m->vals = NULL;
        return SS_ENOMEM;
    }
    m->mask = slots - 1;
    return 0;
}

int ss_pkmemo_init(ss_pkmemo *m)
{
    memset(m, 0, sizeof(*m));
    return alloc_table(m, 1024);
}

void ss_pkmemo_destroy(ss_pkmemo *m)
{
    if (m == NULL)
        return;
    free(m->keys);
    free(m->vals);
    memset(m, 0, sizeof(*m));
}

int ss_pkmemo_get(const ss_pkmemo *m, uintptr_t key, uint32_t *val)
{
    assert(key != 0);
    for (size_t i = slot_of(key, m->mask);; i = (i + 1) & m->mask) {
        if (m->keys[i] == key) {
            *val = m->vals[i];
            return 1;
        }
        if (m->keys[i] == 0)
            return 0;
    }
}

static void insert(ss_pkmemo *m, uintptr_t key, uint32_t val)
{
    size_t i = slot_of(key, m->mask);
    while (m->keys[i] != 0) {
        assert(m->keys[i] != key);
        i = (i + 1) & m->mask;
    }
    m->keys[i] = key;
    m->vals[i] = val;
}

int ss_pkmemo_put(ss_pkmemo *m, uintptr_t key, uint32_t val)
{
    assert(key != 0);
    if ((m->used + 1) * 2 > m->mask + 1) { /* keep the load under 1/2 */
        ss_pkmemo old = *m;
        if (old.mask + 1 > SIZE_MAX / 2 / sizeof(uintptr_t) ||
            alloc_table(m, (old.mask + 1) * 2) < 0) {
            *m = old;
            return SS_ENOMEM;
        }
        for (size_t i = 0; i <= old.mask; i++)
            if (old.keys[i])
                insert(m, old.keys[i], old.vals[i]);
        free(old.keys);
        free(old.vals);
    }
    insert(m, key, val);
    m->used++;
    return 0;
}

int ss_pkmemo_next(const ss_pkmemo *m, size_t *pos, uintptr_t *key)
{
    for (; m->keys && *pos <= m->mask; (*pos)++) {
        if (m->keys[*pos]) {
            *key = m->keys[(*pos)++];
            return 1;
        }
    }
    return 0;
}
