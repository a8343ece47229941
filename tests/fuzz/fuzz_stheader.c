/* fuzz_stheader.c - libFuzzer harness for the safetensors header parser
 * (csrc/core/ss_stheader.c).
 *
 * Each input is tried two ways: as a whole file (8-byte length, header,
 * data: ss_st_prefix then ss_st_parse on the rest), and as the header JSON
 * alone with the data's length unknown (SS_ST_ANY_LEN). Built with
 * -fsanitize=fuzzer,address,undefined (make fuzz): any read past the
 * input, leak or undefined behaviour is a crash. Beyond that it checks what
 * ss_stheader.h promises of an accepted header:
 *  - parse returns 0, SS_EINVAL, SS_ERANGE or SS_ENOMEM; on failure no
 *    result and err->code set, on success err untouched;
 *  - every name, metadata key and value lies inside the strings, is valid
 *    UTF-8 and no two tensor names (no two metadata keys) are equal;
 *  - every dtype is known, ndim <= SS_ST_NDIM_MAX, end - begin is the
 *    element count times the item size, end <= the data's length;
 *  - sorted by (begin, end), the tensors tile [0, data_len) exactly (up to
 *    the last end when the length is unknown);
 *  - parse is deterministic, and a header accepted with the length unknown
 *    is accepted, with the same entries, for exactly the length its last
 *    tensor ends at, and refused for one byte more.
 * A violated property aborts, so libFuzzer keeps the input. */
#include "ss_stheader.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond)                                                            \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "fuzz_stheader: %s failed (line %d)\n", #cond,     \
                    __LINE__);                                                 \
            abort();                                                           \
        }                                                                      \
    } while (0)

static int valid_utf8(const unsigned char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        size_t k;
        unsigned cp;
        if (c < 0x80) {
            i++;
            continue;
        }
        k = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 0;
        if (k == 0 || i + k > n)
            return 0;
        cp = c & (0xffu >> (k + 1));
        for (size_t j = 1; j < k; j++) {
            if ((s[i + j] & 0xc0) != 0x80)
                return 0;
            cp = cp << 6 | (s[i + j] & 0x3fu);
        }
        if ((k == 2 && cp < 0x80) || (k == 3 && cp < 0x800) ||
            (k == 4 && cp < 0x10000) || cp > 0x10ffff ||
            (cp >= 0xd800 && cp <= 0xdfff))
            return 0;
        i += k;
    }
    return 1;
}

static size_t strings_len(const ss_st_header *h)
{
    size_t n = 0;
    for (size_t i = 0; i < h->ntensors; i++)
        n += h->tensors[i].name_len;
    for (size_t i = 0; i < h->nmeta; i++)
        n += h->meta[4 * i + 1] + h->meta[4 * i + 3];
    return n;
}

static int cmp_u64pair(const void *a, const void *b)
{
    const uint64_t *x = a, *y = b;
    if (x[0] != y[0])
        return x[0] < y[0] ? -1 : 1;
    return x[1] < y[1] ? -1 : x[1] > y[1];
}

static int same_str(const ss_st_header *h, size_t a, size_t alen, size_t b,
                    size_t blen)
{
    return alen == blen && memcmp(h->strings + a, h->strings + b, alen) == 0;
}

/* Returns the last tensor's end. */
static uint64_t check_header(const ss_st_header *h, uint64_t data_len)
{
    size_t slen = strings_len(h);
    uint64_t (*spans)[2] = malloc((h->ntensors + 1) * sizeof *spans);
    uint64_t cursor = 0;
    CHECK(spans != NULL);
    CHECK(h->has_metadata || h->nmeta == 0);
    for (size_t i = 0; i < h->ntensors; i++) {
        const ss_st_tensor *t = &h->tensors[i];
        uint64_t numel = 1;
        CHECK(t->name_off <= slen && t->name_len <= slen - t->name_off);
        CHECK(valid_utf8((const unsigned char *)h->strings + t->name_off,
                         t->name_len));
        CHECK(ss_st_dtype_name(t->dtype) != NULL);
        CHECK(t->ndim >= 0 && t->ndim <= SS_ST_NDIM_MAX);
        for (int d = 0; d < t->ndim; d++) {
            int64_t v = h->dims[t->shape_off + (size_t)d];
            CHECK(v >= 0);
            numel *= (uint64_t)v; /* cannot wrap: parse checked it */
        }
        CHECK(t->begin <= t->end);
        CHECK(t->end - t->begin == numel * ss_st_dtype_size(t->dtype));
        CHECK(data_len == SS_ST_ANY_LEN || t->end <= data_len);
        for (size_t j = 0; j < i; j++) /* small inputs: quadratic is fine */
            CHECK(!same_str(h, t->name_off, t->name_len, h->tensors[j].name_off,
                            h->tensors[j].name_len));
        spans[i][0] = t->begin;
        spans[i][1] = t->end;
    }
    for (size_t i = 0; i < h->nmeta; i++) {
        const size_t *m = h->meta + 4 * i;
        CHECK(m[0] <= slen && m[1] <= slen - m[0]);
        CHECK(m[2] <= slen && m[3] <= slen - m[2]);
        CHECK(valid_utf8((const unsigned char *)h->strings + m[0], m[1]));
        CHECK(valid_utf8((const unsigned char *)h->strings + m[2], m[3]));
        for (size_t j = 0; j < i; j++)
            CHECK(!same_str(h, m[0], m[1], h->meta[4 * j], h->meta[4 * j + 1]));
    }
    qsort(spans, h->ntensors, sizeof *spans, cmp_u64pair);
    for (size_t i = 0; i < h->ntensors; i++) {
        CHECK(spans[i][0] == cursor);
        cursor = spans[i][1];
    }
    CHECK(data_len == SS_ST_ANY_LEN || cursor == data_len);
    free(spans);
    return cursor;
}

static void same_result(const ss_st_header *a, const ss_st_header *b)
{
    CHECK(a->ntensors == b->ntensors && a->nmeta == b->nmeta);
    CHECK(a->has_metadata == b->has_metadata);
    for (size_t i = 0; i < a->ntensors; i++) {
        const ss_st_tensor *x = &a->tensors[i], *y = &b->tensors[i];
        CHECK(x->dtype == y->dtype && x->ndim == y->ndim);
        CHECK(x->begin == y->begin && x->end == y->end);
        CHECK(x->name_len == y->name_len &&
              memcmp(a->strings + x->name_off, b->strings + y->name_off,
                     x->name_len) == 0);
        CHECK(memcmp(a->dims + x->shape_off, b->dims + y->shape_off,
                     (size_t)x->ndim * sizeof *a->dims) == 0);
    }
}

static int parse(const uint8_t *p, size_t n, uint64_t data_len,
                 ss_st_header **h)
{
    ss_errinfo err;
    int rc;
    ss_errinfo_clear(&err);
    rc = ss_st_parse(p, n, data_len, h, &err);
    CHECK(rc == 0 || rc == SS_EINVAL || rc == SS_ERANGE || rc == SS_ENOMEM);
    if (rc < 0) {
        CHECK(*h == NULL && err.code == rc && err.detail[0] != '\0');
    } else {
        CHECK(*h != NULL && err.code == 0);
    }
    return rc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len)
{
    ss_st_header *h = NULL, *h2 = NULL;
    uint64_t n, end;
    ss_errinfo err;

    /* as a whole file */
    ss_errinfo_clear(&err);
    if (len >= 8 && ss_st_prefix(data, len, &n, &err) == 0) {
        CHECK(n <= len - 8 && n <= SS_ST_HEADER_MAX);
        if (parse(data + 8, (size_t)n, len - 8 - n, &h) == 0)
            check_header(h, len - 8 - n);
        ss_st_free(h);
        h = NULL;
    } else {
        CHECK(len < 8 || err.code == SS_ERANGE);
    }

    /* as the header alone, the data's length unknown */
    if (parse(data, len, SS_ST_ANY_LEN, &h) < 0)
        return 0;
    end = check_header(h, SS_ST_ANY_LEN);
    CHECK(parse(data, len, SS_ST_ANY_LEN, &h2) == 0);
    same_result(h, h2);
    ss_st_free(h2);
    h2 = NULL;
    CHECK(parse(data, len, end, &h2) == 0);
    same_result(h, h2);
    ss_st_free(h2);
    h2 = NULL;
    if (end < INT64_MAX)
        CHECK(parse(data, len, end + 1, &h2) < 0);
    ss_st_free(h);
    return 0;
}
