/* ss_stheader.c - strict parse of a safetensors header (ss_stheader.h).
 *
 * One pass over the JSON, directed by the header's schema: the top-level
 * object, its entries (an object of three known keys, the shape an array
 * of integers) and __metadata__ (an object of strings). Anything else at
 * the top (an array, a number) is walked by a generic, depth-bounded
 * validator only so the error says whether it was JSON at all. Strings
 * are decoded into one arena allocated up front (a decoded string is never
 * longer than its JSON form); the other tables grow by doubling.
 * Duplicate keys are found after the pass by sorting; the tiling of the
 * data by sorting the tensors by (begin, end).
 *
 * Every read of the input goes through the cursor's bounds (p < end);
 * recursion happens only in skip_value, bounded by SS_ST_DEPTH_MAX.
 * Thread-safe: no state outside the parser struct on the stack. */
#include "ss_stheader.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define METADATA_KEY "__metadata__"
#define DIM_LIMIT ((int64_t)1 << 62)
#define OFFSET_LIMIT INT64_MAX

/* safetensors' Dtype names with shardstate's torch counterparts. */
static const struct {
    const char *name;
    size_t size;
} dtypes[] = {
    {"BOOL", 1},    {"U8", 1},          {"I8", 1},          {"F8_E5M2", 1},
    {"F8_E4M3", 1}, {"F8_E4M3FNUZ", 1}, {"F8_E5M2FNUZ", 1}, {"F8_E8M0", 1},
    {"I16", 2},     {"U16", 2},         {"F16", 2},         {"BF16", 2},
    {"I32", 4},     {"U32", 4},         {"F32", 4},         {"C64", 8},
    {"F64", 8},     {"I64", 8},         {"U64", 8},
};
#define NDTYPES ((int)(sizeof dtypes / sizeof dtypes[0]))

int ss_st_ndtypes(void)
{
    return NDTYPES;
}

const char *ss_st_dtype_name(int dtype)
{
    return dtype >= 0 && dtype < NDTYPES ? dtypes[dtype].name : NULL;
}

size_t ss_st_dtype_size(int dtype)
{
    return dtype >= 0 && dtype < NDTYPES ? dtypes[dtype].size : 0;
}

typedef struct parser {
    const uint8_t *base, *p, *end;
    ss_errinfo *err;
    int rc;
    char *str; /* arena: len + 1 bytes */
    size_t nstr;
    int64_t *dims;
    size_t ndims, capdims;
    ss_st_tensor *t;
    size_t nt, capt;
    size_t *meta; /* 4 per key */
    size_t nmeta, capmeta;
    int has_meta, seen_meta;
    int code; /* the code tensor_fail reports: SS_EINVAL but for ranges */
} parser;

/* A name as Python's repr shows a plain one: 'name', with quotes,
 * backslashes and control bytes escaped, cut at 60 bytes. */
static void quote(const parser *ps, size_t off, size_t len, char *out,
                  size_t cap)
{
    const unsigned char *s = (const unsigned char *)ps->str + off;
    size_t n = 0, shown = len > 60 ? 60 : len;
    out[n++] = '\'';
    for (size_t i = 0; i < shown && n + 8 < cap; i++) {
        unsigned c = s[i];
        if (c == '\'' || c == '\\')
            n += (size_t)snprintf(out + n, cap - n, "\\%c", c);
        else if (c < 0x20 || c == 0x7f)
            n += (size_t)snprintf(out + n, cap - n, "\\x%02x", c);
        else
            out[n++] = (char)c;
    }
    if (shown < len && n + 4 < cap) {
        memcpy(out + n, "...", 3);
        n += 3;
    }
    out[n++] = '\'';
    out[n] = '\0';
}

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static int fail(parser *ps, int code, const char *fmt, ...)
{
    char buf[SS_ERR_DETAIL_MAX];
    va_list ap;
    if (ps->rc < 0)
        return ps->rc;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    ps->rc = code;
    return ss_errinfo_set(ps->err, code, "safetensors header", NULL,
                          (int64_t)(ps->p - ps->base), "%s", buf);
}

static int json_fail(parser *ps, const char *what)
{
    return fail(ps, SS_EINVAL, "header is not valid JSON: %s at byte %zu", what,
                (size_t)(ps->p - ps->base));
}

/* "tensor 'name': " + the rest. */
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static int tensor_fail(parser *ps, size_t t, const char *fmt, ...)
{
    char name[80], rest[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(rest, sizeof rest, fmt, ap);
    va_end(ap);
    quote(ps, ps->t[t].name_off, ps->t[t].name_len, name, sizeof name);
    return fail(ps, ps->code, "tensor %s: %s", name, rest);
}

static int grow(void **arr, size_t *cap, size_t need, size_t item)
{
    size_t n = *cap ? *cap : 16;
    void *q;
    if (need <= *cap)
        return 0;
    while (n < need)
        n *= 2;
    q = realloc(*arr, n * item);
    if (q == NULL)
        return -1;
    *arr = q;
    *cap = n;
    return 0;
}

static void skip_ws(parser *ps)
{
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' ||
                               *ps->p == '\n' || *ps->p == '\r'))
        ps->p++;
}

/* Consume c (after whitespace), or fail with a JSON error. */
static int expect(parser *ps, char c, const char *what)
{
    skip_ws(ps);
    if (ps->p >= ps->end || *ps->p != (uint8_t)c)
        return json_fail(ps, what);
    ps->p++;
    return 0;
}

/* After an object's member: 1 when a ',' says another follows, 0 after the
 * closing '}', < 0 (the error) on anything else. */
static int next_member(parser *ps)
{
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == ',') {
        ps->p++;
        return 1;
    }
    return expect(ps, '}', "expected ',' or '}'") < 0 ? ps->rc : 0;
}

static int hex4(parser *ps, unsigned *v)
{
    *v = 0;
    if (ps->end - ps->p < 4)
        return json_fail(ps, "short \\u escape");
    for (int i = 0; i < 4; i++) {
        unsigned c = *ps->p++, d;
        if (c >= '0' && c <= '9')
            d = c - '0';
        else if ((c | 0x20) >= 'a' && (c | 0x20) <= 'f')
            d = (c | 0x20) - 'a' + 10;
        else
            return json_fail(ps, "bad \\u escape");
        *v = *v << 4 | d;
    }
    return 0;
}

static size_t put_utf8(char *o, unsigned cp)
{
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xc0 | cp >> 6);
        o[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xe0 | cp >> 12);
        o[1] = (char)(0x80 | (cp >> 6 & 0x3f));
        o[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    o[0] = (char)(0xf0 | cp >> 18);
    o[1] = (char)(0x80 | (cp >> 12 & 0x3f));
    o[2] = (char)(0x80 | (cp >> 6 & 0x3f));
    o[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* Length of the valid UTF-8 sequence at p (lead byte >= 0x80), 0 if none:
 * no overlongs, no surrogates, nothing above U+10FFFF. */
static size_t utf8_len(const uint8_t *p, const uint8_t *end)
{
    unsigned c = p[0];
    size_t n;
    unsigned lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf)
        n = 2;
    else if (c >= 0xe0 && c <= 0xef) {
        n = 3;
        if (c == 0xe0)
            lo = 0xa0;
        else if (c == 0xed)
            hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        n = 4;
        if (c == 0xf0)
            lo = 0x90;
        else if (c == 0xf4)
            hi = 0x8f;
    } else
        return 0;
    if ((size_t)(end - p) < n || p[1] < lo || p[1] > hi)
        return 0;
    for (size_t i = 2; i < n; i++)
        if ((p[i] & 0xc0) != 0x80)
            return 0;
    return n;
}

/* A JSON string at the cursor, decoded into the arena: *off, *len. */
static int parse_string(parser *ps, size_t *off, size_t *len)
{
    char *o;
    if (expect(ps, '"', "expected a string") < 0)
        return ps->rc;
    *off = ps->nstr;
    o = ps->str + ps->nstr;
    for (;;) {
        unsigned c;
        if (ps->p >= ps->end)
            return json_fail(ps, "unterminated string");
        c = *ps->p;
        if (c == '"') {
            ps->p++;
            break;
        }
        if (c < 0x20)
            return json_fail(ps, "control character in a string");
        if (c >= 0x80) {
            size_t n = utf8_len(ps->p, ps->end);
            if (n == 0)
                return json_fail(ps, "invalid UTF-8");
            memcpy(o, ps->p, n);
            o += n;
            ps->p += n;
            continue;
        }
        ps->p++;
        if (c != '\\') {
            *o++ = (char)c;
            continue;
        }
        if (ps->p >= ps->end)
            return json_fail(ps, "unterminated string");
        c = *ps->p++;
        switch (c) {
        case '"':
        case '\\':
        case '/':
            *o++ = (char)c;
            break;
        case 'b':
            *o++ = '\b';
            break;
        case 'f':
            *o++ = '\f';
            break;
        case 'n':
            *o++ = '\n';
            break;
        case 'r':
            *o++ = '\r';
            break;
        case 't':
            *o++ = '\t';
            break;
        case 'u': {
            unsigned cp, lo;
            if (hex4(ps, &cp) < 0)
                return ps->rc;
            if (cp >= 0xdc00 && cp <= 0xdfff)
                return json_fail(ps, "lone low surrogate");
            if (cp >= 0xd800 && cp <= 0xdbff) {
                if (ps->end - ps->p < 2 || ps->p[0] != '\\' || ps->p[1] != 'u')
                    return json_fail(ps, "lone high surrogate");
                ps->p += 2;
                if (hex4(ps, &lo) < 0)
                    return ps->rc;
                if (lo < 0xdc00 || lo > 0xdfff)
                    return json_fail(ps, "unpaired surrogate");
                cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            }
            o += put_utf8(o, cp);
            break;
        }
        default:
            return json_fail(ps, "bad escape");
        }
    }
    *len = (size_t)(o - (ps->str + *off));
    ps->nstr += *len;
    return 0;
}

/* A JSON number at the cursor. 0: a plain integer 0 .. limit in *v;
 * 1: a valid number that is not one; < 0: not a number (JSON error). */
static int parse_number(parser *ps, int64_t limit, int64_t *v)
{
    int neg = 0, frac = 0, big = 0;
    uint64_t acc = 0;
    if (ps->p < ps->end && *ps->p == '-') {
        neg = 1;
        ps->p++;
    }
    if (ps->p >= ps->end || *ps->p < '0' || *ps->p > '9')
        return json_fail(ps, "expected a value");
    if (*ps->p == '0') {
        ps->p++;
    } else {
        while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9') {
            unsigned d = *ps->p++ - '0';
            if (acc > ((uint64_t)limit - d) / 10)
                big = 1;
            else
                acc = acc * 10 + d;
        }
    }
    if (ps->p < ps->end && *ps->p == '.') {
        frac = 1;
        ps->p++;
        if (ps->p >= ps->end || *ps->p < '0' || *ps->p > '9')
            return json_fail(ps, "bad number");
        while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9')
            ps->p++;
    }
    if (ps->p < ps->end && (*ps->p | 0x20) == 'e') {
        frac = 1;
        ps->p++;
        if (ps->p < ps->end && (*ps->p == '+' || *ps->p == '-'))
            ps->p++;
        if (ps->p >= ps->end || *ps->p < '0' || *ps->p > '9')
            return json_fail(ps, "bad number");
        while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9')
            ps->p++;
    }
    if (neg || frac || big)
        return 1;
    *v = (int64_t)acc;
    return 0;
}

static int literal(parser *ps, const char *word)
{
    size_t n = strlen(word);
    if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, word, n) != 0)
        return json_fail(ps, "expected a value");
    ps->p += n;
    return 0;
}

/* Any JSON value, checked and skipped; nesting bounded. */
static int skip_value(parser *ps, int depth)
{
    size_t off, len;
    int64_t v;
    skip_ws(ps);
    if (ps->p >= ps->end)
        return json_fail(ps, "expected a value");
    switch (*ps->p) {
    case '{':
    case '[': {
        char close = *ps->p == '{' ? '}' : ']';
        int obj = close == '}';
        if (depth >= SS_ST_DEPTH_MAX)
            return fail(ps, SS_EINVAL,
                        "header JSON nested too deeply (more than %d levels)",
                        SS_ST_DEPTH_MAX);
        ps->p++;
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == (uint8_t)close) {
            ps->p++;
            return 0;
        }
        for (;;) {
            if (obj) {
                if (parse_string(ps, &off, &len) < 0 ||
                    expect(ps, ':', "expected ':'") < 0)
                    return ps->rc;
                ps->nstr = off; /* keys of skipped values are not kept */
            }
            if (skip_value(ps, depth + 1) < 0)
                return ps->rc;
            skip_ws(ps);
            if (ps->p < ps->end && *ps->p == ',') {
                ps->p++;
                continue;
            }
            return expect(ps, close, "expected ',' or a closing bracket");
        }
    }
    case '"':
        if (parse_string(ps, &off, &len) < 0)
            return ps->rc;
        ps->nstr = off;
        return 0;
    case 't':
        return literal(ps, "true");
    case 'f':
        return literal(ps, "false");
    case 'n':
        return literal(ps, "null");
    default:
        return parse_number(ps, INT64_MAX, &v) < 0 ? ps->rc : 0;
    }
}

static int same(const parser *ps, size_t off, size_t len, const char *lit)
{
    return len == strlen(lit) && memcmp(ps->str + off, lit, len) == 0;
}

/* A list of integers 0 .. limit (shape or offsets) for tensor t; *n set.
 * Appends to dims. 1: not such a list (the caller names the field). */
static int int_list(parser *ps, int64_t limit, size_t maxn, size_t *n)
{
    *n = 0;
    skip_ws(ps);
    if (ps->p >= ps->end || *ps->p != '[')
        return skip_value(ps, 2) < 0 ? ps->rc : 1;
    ps->p++;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == ']') {
        ps->p++;
        return 0;
    }
    for (;;) {
        int64_t v = 0;
        int r;
        skip_ws(ps);
        if (ps->p < ps->end &&
            ((*ps->p >= '0' && *ps->p <= '9') || *ps->p == '-')) {
            r = parse_number(ps, limit, &v);
            if (r < 0)
                return ps->rc;
        } else {
            return skip_value(ps, 3) < 0 ? ps->rc : 1;
        }
        if (r == 1 || *n >= maxn)
            return 1;
        if (grow((void **)&ps->dims, &ps->capdims, ps->ndims + 1,
                 sizeof *ps->dims) < 0)
            return fail(ps, SS_ENOMEM, "out of memory");
        ps->dims[ps->ndims++] = v;
        ++*n;
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') {
            ps->p++;
            continue;
        }
        return expect(ps, ']', "expected ',' or ']'");
    }
}

static void fmt_dims(const int64_t *d, size_t n, char *out, size_t cap)
{
    size_t k = 0;
    out[k++] = '[';
    for (size_t i = 0; i < n && k + 24 < cap; i++)
        k += (size_t)snprintf(out + k, cap - k, "%s%lld", i ? ", " : "",
                              (long long)d[i]);
    if (k + 2 > cap)
        k = cap - 2;
    out[k++] = ']';
    out[k] = '\0';
}

#define EXACTLY "entry must hold exactly dtype, shape and data_offsets"

/* Tensor t's entry: an object of dtype, shape and data_offsets. */
static int parse_entry(parser *ps, size_t t, uint64_t data_len)
{
    ss_st_tensor *e = &ps->t[t];
    unsigned seen = 0;
    size_t off, len, n, ndims0 = ps->ndims;
    int64_t offs[2] = {0, 0};
    char dims[96];

    skip_ws(ps);
    if (ps->p >= ps->end || *ps->p != '{')
        return skip_value(ps, 1) < 0 ? ps->rc : tensor_fail(ps, t, EXACTLY);
    ps->p++;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == '}')
        return tensor_fail(ps, t, EXACTLY);
    e->shape_off = ndims0;
    for (;;) {
        unsigned bit;
        if (parse_string(ps, &off, &len) < 0 ||
            expect(ps, ':', "expected ':'") < 0)
            return ps->rc;
        bit = same(ps, off, len, "dtype")          ? 1u
              : same(ps, off, len, "shape")        ? 2u
              : same(ps, off, len, "data_offsets") ? 4u
                                                   : 0u;
        ps->nstr = off;
        if (bit == 0)
            return tensor_fail(ps, t, EXACTLY);
        if (seen & bit)
            return tensor_fail(ps, t, "duplicate key in its entry");
        seen |= bit;
        if (bit == 1) {
            int d;
            skip_ws(ps);
            if (ps->p >= ps->end || *ps->p != '"')
                return skip_value(ps, 2) < 0
                           ? ps->rc
                           : tensor_fail(ps, t, "unknown dtype (not a string)");
            if (parse_string(ps, &off, &len) < 0)
                return ps->rc;
            for (d = 0; d < NDTYPES; d++)
                if (same(ps, off, len, dtypes[d].name))
                    break;
            if (d == NDTYPES) {
                char q[80];
                quote(ps, off, len, q, sizeof q);
                return tensor_fail(ps, t, "unknown dtype %s", q);
            }
            ps->nstr = off;
            e->dtype = d;
        } else if (bit == 2) {
            int r = int_list(ps, DIM_LIMIT - 1, SS_ST_NDIM_MAX, &n);
            if (r < 0)
                return ps->rc;
            if (r == 1)
                return tensor_fail(ps, t,
                                   "bad shape (a list of at most %d integers "
                                   "0 .. 2^62 - 1 expected)",
                                   SS_ST_NDIM_MAX);
            /* the shape's dims come first in dims for this entry */
            if (seen & 4u) { /* offsets were appended before: move them */
                int64_t a = ps->dims[ndims0], b = ps->dims[ndims0 + 1];
                memmove(ps->dims + ndims0, ps->dims + ndims0 + 2,
                        n * sizeof *ps->dims);
                ps->dims[ndims0 + n] = a;
                ps->dims[ndims0 + n + 1] = b;
            }
            e->ndim = (int)n;
        } else {
            int r = int_list(ps, OFFSET_LIMIT, 2, &n);
            if (r < 0)
                return ps->rc;
            if (r == 1 || n != 2)
                return tensor_fail(ps, t,
                                   "bad data_offsets (a list [begin, end] of "
                                   "integers 0 .. 2^63 - 1 expected)");
        }
        int r = next_member(ps);
        if (r < 0)
            return r;
        if (r == 0)
            break;
    }
    if (seen != 7u)
        return tensor_fail(ps, t, EXACTLY);
    /* dims: the shape's ndim values, then the two offsets */
    offs[0] = ps->dims[ndims0 + (size_t)e->ndim];
    offs[1] = ps->dims[ndims0 + (size_t)e->ndim + 1];
    ps->ndims -= 2;
    if (offs[0] > offs[1])
        return tensor_fail(ps, t, "bad data_offsets [%lld, %lld]",
                           (long long)offs[0], (long long)offs[1]);
    {
        const int64_t *d = ps->dims + ndims0;
        uint64_t numel = 1, nbytes;
        int over = 0;
        size_t isz = dtypes[e->dtype].size;
        fmt_dims(d, (size_t)e->ndim, dims, sizeof dims);
        for (int i = 0; i < e->ndim; i++) {
            if (d[i] && numel > (uint64_t)INT64_MAX / (uint64_t)d[i])
                over = 1;
            else
                numel *= (uint64_t)d[i];
        }
        for (int i = 0; over && i < e->ndim; i++)
            over = d[i] != 0; /* a zero dim makes any product 0 */
        if (!over && numel > (uint64_t)INT64_MAX / isz)
            over = 1;
        if (over)
            return tensor_fail(ps, t, "bad shape %s: its byte size overflows",
                               dims);
        nbytes = numel * isz;
        if ((uint64_t)(offs[1] - offs[0]) != nbytes)
            return tensor_fail(ps, t,
                               "data_offsets [%lld, %lld] hold %llu bytes, "
                               "its dtype %s and shape %s need %llu",
                               (long long)offs[0], (long long)offs[1],
                               (unsigned long long)(offs[1] - offs[0]),
                               dtypes[e->dtype].name, dims,
                               (unsigned long long)nbytes);
        if ((uint64_t)offs[1] > data_len) {
            ps->code = SS_ERANGE;
            return tensor_fail(ps, t,
                               "data_offsets [%lld, %lld] reach past the end "
                               "of the data (%llu bytes; the file is "
                               "truncated or the header is wrong)",
                               (long long)offs[0], (long long)offs[1],
                               (unsigned long long)data_len);
        }
    }
    e->begin = (uint64_t)offs[0];
    e->end = (uint64_t)offs[1];
    return 0;
}

#define NOT_MAP "__metadata__ must map strings to strings"

static int parse_metadata(parser *ps)
{
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == 'n') {
        if (literal(ps, "null") < 0)
            return ps->rc;
        return 0;
    }
    if (ps->p >= ps->end || *ps->p != '{')
        return skip_value(ps, 1) < 0 ? ps->rc : fail(ps, SS_EINVAL, NOT_MAP);
    ps->has_meta = 1;
    ps->p++;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == '}') {
        ps->p++;
        return 0;
    }
    for (;;) {
        size_t *m;
        if (grow((void **)&ps->meta, &ps->capmeta, 4 * (ps->nmeta + 1),
                 sizeof *ps->meta) < 0)
            return fail(ps, SS_ENOMEM, "out of memory");
        m = ps->meta + 4 * ps->nmeta;
        if (parse_string(ps, &m[0], &m[1]) < 0 ||
            expect(ps, ':', "expected ':'") < 0)
            return ps->rc;
        skip_ws(ps);
        if (ps->p >= ps->end || *ps->p != '"')
            return skip_value(ps, 2) < 0 ? ps->rc
                                         : fail(ps, SS_EINVAL, NOT_MAP);
        if (parse_string(ps, &m[2], &m[3]) < 0)
            return ps->rc;
        ps->nmeta++;
        int r = next_member(ps);
        if (r <= 0)
            return r;
    }
}

/* A key to sort: its decoded bytes. */
typedef struct keyref {
    const char *s;
    size_t len;
    size_t idx;
} keyref;

static int cmp_key(const void *a, const void *b)
{
    const keyref *x = a, *y = b;
    size_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->s, y->s, n);
    if (c)
        return c;
    return x->len < y->len ? -1 : x->len > y->len;
}

typedef struct span {
    uint64_t begin, end;
    size_t idx;
} span;

static int cmp_span(const void *a, const void *b)
{
    const span *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

/* No key twice among the tensor names (meta 0) or the metadata keys. */
static int no_duplicates(parser *ps, int meta)
{
    size_t n = meta ? ps->nmeta : ps->nt;
    keyref *k;
    int rc = 0;
    if (n < 2)
        return 0;
    k = malloc(n * sizeof *k);
    if (k == NULL)
        return fail(ps, SS_ENOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        k[i].s = ps->str + (meta ? ps->meta[4 * i] : ps->t[i].name_off);
        k[i].len = meta ? ps->meta[4 * i + 1] : ps->t[i].name_len;
        k[i].idx = i;
    }
    qsort(k, n, sizeof *k, cmp_key);
    for (size_t i = 1; i < n; i++)
        if (cmp_key(&k[i - 1], &k[i]) == 0) {
            char q[80];
            quote(ps, (size_t)(k[i].s - ps->str), k[i].len, q, sizeof q);
            rc = fail(ps, SS_EINVAL, "duplicate key %s", q);
            break;
        }
    free(k);
    return rc;
}

/* Sorted by (begin, end), the tensors tile [0, data_len) exactly. */
static int check_tiling(parser *ps, uint64_t data_len)
{
    span *s;
    uint64_t cursor = 0;
    size_t last = 0;
    int rc = 0;
    if (ps->nt == 0)
        return data_len && data_len != SS_ST_ANY_LEN
                   ? fail(ps, SS_EINVAL,
                          "no tensor covers the data's %llu bytes",
                          (unsigned long long)data_len)
                   : 0;
    s = malloc(ps->nt * sizeof *s);
    if (s == NULL)
        return fail(ps, SS_ENOMEM, "out of memory");
    for (size_t i = 0; i < ps->nt; i++) {
        s[i].begin = ps->t[i].begin;
        s[i].end = ps->t[i].end;
        s[i].idx = i;
    }
    qsort(s, ps->nt, sizeof *s, cmp_span);
    for (size_t i = 0; i < ps->nt && rc == 0; i++) {
        if (s[i].begin < cursor) {
            char a[80], b[80];
            quote(ps, ps->t[last].name_off, ps->t[last].name_len, a, sizeof a);
            quote(ps, ps->t[s[i].idx].name_off, ps->t[s[i].idx].name_len, b,
                  sizeof b);
            rc = fail(ps, SS_EINVAL, "tensors %s and %s overlap in the data", a,
                      b);
        } else if (s[i].begin > cursor) {
            rc = tensor_fail(ps, s[i].idx,
                             "data_offsets begin at %llu, leaving the data "
                             "bytes [%llu, %llu) to no tensor (a hole)",
                             (unsigned long long)s[i].begin,
                             (unsigned long long)cursor,
                             (unsigned long long)s[i].begin);
        }
        cursor = s[i].end;
        last = s[i].idx;
    }
    if (rc == 0 && cursor != data_len && data_len != SS_ST_ANY_LEN)
        rc = fail(ps, SS_EINVAL,
                  "the tensors' data ends at byte %llu of the data's %llu "
                  "(bytes after the last tensor)",
                  (unsigned long long)cursor, (unsigned long long)data_len);
    free(s);
    return rc;
}

static int parse_top(parser *ps, uint64_t data_len)
{
    size_t off, len;
    if (ps->p >= ps->end || *ps->p != '{') {
        /* is it JSON at all? then say what it is not */
        if (skip_value(ps, 0) < 0)
            return ps->rc;
        skip_ws(ps);
        if (ps->p != ps->end)
            return json_fail(ps, "trailing characters");
        ps->p = ps->base;
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == '{')
            return fail(ps, SS_EINVAL, "header does not begin with '{'");
        return fail(ps, SS_EINVAL, "header is not a JSON object");
    }
    ps->p++;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == '}') {
        ps->p++;
    } else {
        for (;;) {
            if (parse_string(ps, &off, &len) < 0 ||
                expect(ps, ':', "expected ':'") < 0)
                return ps->rc;
            if (same(ps, off, len, METADATA_KEY)) {
                if (ps->seen_meta)
                    return fail(ps, SS_EINVAL,
                                "duplicate key '" METADATA_KEY "'");
                ps->seen_meta = 1;
                ps->nstr = off;
                if (parse_metadata(ps) < 0)
                    return ps->rc;
            } else {
                ss_st_tensor *e;
                if (grow((void **)&ps->t, &ps->capt, ps->nt + 1,
                         sizeof *ps->t) < 0)
                    return fail(ps, SS_ENOMEM, "out of memory");
                e = &ps->t[ps->nt];
                memset(e, 0, sizeof *e);
                e->name_off = off;
                e->name_len = len;
                if (parse_entry(ps, ps->nt++, data_len) < 0)
                    return ps->rc;
            }
            int r = next_member(ps);
            if (r < 0)
                return r;
            if (r == 0)
                break;
        }
    }
    skip_ws(ps);
    if (ps->p != ps->end)
        return json_fail(ps, "trailing characters");
    if (no_duplicates(ps, 0) < 0 || no_duplicates(ps, 1) < 0)
        return ps->rc;
    return check_tiling(ps, data_len);
}

int ss_st_prefix(const uint8_t prefix[8], uint64_t file_size,
                 uint64_t *head_len, ss_errinfo *err)
{
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | prefix[i];
    *head_len = 0;
    if (n > SS_ST_HEADER_MAX)
        return ss_errinfo_set(err, SS_ERANGE, "safetensors header", NULL, 0,
                              "header length %llu exceeds the limit %u",
                              (unsigned long long)n, SS_ST_HEADER_MAX);
    if (file_size < 8 || n > file_size - 8)
        return ss_errinfo_set(err, SS_ERANGE, "safetensors header", NULL, 0,
                              "header length %llu reaches past the end of "
                              "the file (%llu bytes)",
                              (unsigned long long)n,
                              (unsigned long long)file_size);
    *head_len = n;
    return 0;
}

/* The result: the header struct and its tables in one allocation. */
int ss_st_parse(const uint8_t *head, size_t len, uint64_t data_len,
                ss_st_header **out, ss_errinfo *err)
{
    parser ps;
    ss_st_header *h = NULL;
    char *mem;
    size_t sz_t, sz_d, sz_m;
    int rc;

    *out = NULL;
    memset(&ps, 0, sizeof ps);
    ps.base = ps.p = head;
    ps.end = head + len;
    ps.err = err;
    ps.code = SS_EINVAL;
    if (len > SS_ST_HEADER_MAX) {
        rc = fail(&ps, SS_ERANGE, "header length %zu exceeds the limit %u", len,
                  SS_ST_HEADER_MAX);
        goto out;
    }
    ps.str = malloc(len + 1);
    if (ps.str == NULL) {
        rc = fail(&ps, SS_ENOMEM, "out of memory");
        goto out;
    }
    rc = parse_top(&ps, data_len);
    if (rc < 0)
        goto out;
    _Static_assert(sizeof(ss_st_tensor) % 8 == 0 &&
                       sizeof(ss_st_header) % 8 == 0,
                   "tables stay 8-byte aligned in one block");
    sz_t = ps.nt * sizeof *ps.t;
    sz_d = ps.ndims * sizeof *ps.dims;
    sz_m = 4 * ps.nmeta * sizeof *ps.meta;
    mem = malloc(sizeof *h + sz_t + sz_d + sz_m + ps.nstr + 1);
    if (mem == NULL) {
        rc = fail(&ps, SS_ENOMEM, "out of memory");
        goto out;
    }
    h = (ss_st_header *)mem;
    mem += sizeof *h;
    /* every table points into the block, even when empty (never NULL,
     * so table + 0 is defined); each size is a multiple of 8 */
    if (sz_t)
        memcpy(mem, ps.t, sz_t);
    h->tensors = (const ss_st_tensor *)(void *)mem;
    mem += sz_t;
    if (sz_d)
        memcpy(mem, ps.dims, sz_d);
    h->dims = (const int64_t *)(void *)mem;
    mem += sz_d;
    if (sz_m)
        memcpy(mem, ps.meta, sz_m);
    h->meta = (const size_t *)(void *)mem;
    mem += sz_m;
    h->strings = memcpy(mem, ps.str, ps.nstr + 1);
    h->ntensors = ps.nt;
    h->nmeta = ps.nmeta;
    h->has_metadata = ps.has_meta;
    *out = h;
out:
    free(ps.str);
    free(ps.dims);
    free(ps.t);
    free(ps.meta);
    return rc;
}

void ss_st_free(ss_st_header *h)
{
    free(h);
}
