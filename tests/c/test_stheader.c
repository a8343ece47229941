/* test_stheader.c - ss_st_prefix / ss_st_parse on hand-written headers:
 * what an accepted header gives back (names, dtypes, shapes, offsets,
 * metadata, escapes decoded), each kind of refusal with its code and a
 * detail naming the tensor, and the unknown-length mode. Runs under ASan,
 * so no parse may read past the header it is given (each is copied into a
 * buffer of exactly its length). */
#include "ss_stheader.h"
#include "ss_test.h"

#include <stdlib.h>
#include <string.h>

/* Parse text (copied to an exact-size buffer) with data_len. */
static int parse(const char *text, uint64_t data_len, ss_st_header **h,
                 ss_errinfo *e)
{
    size_t n = strlen(text);
    uint8_t *b = malloc(n ? n : 1);
    int rc;
    memcpy(b, text, n);
    ss_errinfo_clear(e);
    rc = ss_st_parse(b, n, data_len, h, e);
    free(b);
    return rc;
}

static void test_accepted(void)
{
    ss_st_header *h = NULL;
    ss_errinfo e;
    const char *text =
        "{\"__metadata__\":{\"format\":\"pt\",\"k\\u00e9\":\"v\\n\"},"
        "\"b\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[8,20]},"
        " \"a\\ud83d\\ude00\" : {\"data_offsets\":[0,8],\"shape\":[],"
        "\"dtype\":\"F64\"},\"z\":{\"dtype\":\"I8\",\"shape\":[0],"
        "\"data_offsets\":[20,20]}}   ";
    CHECK_EQ_INT(parse(text, 20, &h, &e), 0);
    if (h == NULL)
        return;
    CHECK_EQ_INT(h->ntensors, 3);
    CHECK(h->has_metadata && h->nmeta == 2);
    CHECK(h->meta[1] == 6 && memcmp(h->strings + h->meta[0], "format", 6) == 0);
    CHECK(h->meta[3] == 2 && memcmp(h->strings + h->meta[2], "pt", 2) == 0);
    CHECK(h->meta[5] == 3 &&
          memcmp(h->strings + h->meta[4], "k\xc3\xa9", 3) == 0);
    CHECK(h->meta[7] == 2);
    CHECK(memcmp(h->strings + h->meta[6], "v\n", 2) == 0);
    CHECK(h->tensors[0].name_len == 1 &&
          h->strings[h->tensors[0].name_off] == 'b');
    CHECK_EQ_INT(h->tensors[0].ndim, 2);
    CHECK_EQ_INT(h->dims[h->tensors[0].shape_off + 1], 3);
    CHECK(strcmp(ss_st_dtype_name(h->tensors[0].dtype), "BF16") == 0);
    CHECK(h->tensors[0].begin == 8 && h->tensors[0].end == 20);
    CHECK(h->tensors[1].name_len == 5 &&
          memcmp(h->strings + h->tensors[1].name_off, "a\xf0\x9f\x98\x80", 5) ==
              0);
    CHECK_EQ_INT(h->tensors[1].ndim, 0);
    CHECK_EQ_INT(ss_st_dtype_size(h->tensors[1].dtype), 8);
    ss_st_free(h);
    /* length unknown: the same header, any data length */
    CHECK_EQ_INT(parse(text, SS_ST_ANY_LEN, &h, &e), 0);
    ss_st_free(h);
    CHECK_EQ_INT(parse("{}", 0, &h, &e), 0);
    CHECK(h != NULL && h->ntensors == 0 && !h->has_metadata);
    ss_st_free(h);
}

static void refused(const char *text, uint64_t data_len, int code,
                    const char *detail)
{
    ss_st_header *h = (ss_st_header *)1;
    ss_errinfo e;
    int rc = parse(text, data_len, &h, &e);
    CHECK_EQ_INT(rc, code);
    CHECK(h == NULL);
    CHECK_EQ_INT(e.code, code);
    if (strstr(e.detail, detail) == NULL) {
        fprintf(stderr, "  detail %s lacks %s\n", e.detail, detail);
        CHECK(0);
    }
}

#define T(x) "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":" x "}}"

static void test_refused(void)
{
    refused(T("[0,8]") "x", 8, SS_EINVAL, "trailing characters");
    refused(" " T("[0,8]"), 8, SS_EINVAL, "does not begin with '{'");
    refused("[1,2]", 0, SS_EINVAL, "not a JSON object");
    refused(T("[0,8]"), 16, SS_EINVAL, "bytes after the last tensor");
    refused(T("[0,8]"), 4, SS_ERANGE, "tensor 'w': data_offsets [0, 8] reach");
    refused(T("[8,0]"), 8, SS_EINVAL, "tensor 'w': bad data_offsets");
    refused(T("[0,12]"), 12, SS_EINVAL, "hold 12 bytes");
    refused(T("[0,8,9]"), 9, SS_EINVAL, "tensor 'w': bad data_offsets");
    refused(T("[0.0,8]"), 8, SS_EINVAL, "tensor 'w': bad data_offsets");
    refused(T("[-0,8]"), 8, SS_EINVAL, "tensor 'w': bad data_offsets");
    refused(T("[01,8]"), 8, SS_EINVAL, "not valid JSON");
    refused("{\"w\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904],"
            "\"data_offsets\":[0,8]}}",
            8, SS_EINVAL, "tensor 'w': bad shape");
    refused("{\"w\":{\"dtype\":\"F32\",\"shape\":[1048576,1048576,1048576,"
            "1048576],\"data_offsets\":[0,8]}}",
            8, SS_EINVAL, "overflows");
    refused("{\"w\":{\"dtype\":\"F12\",\"shape\":[2],\"data_offsets\":[0,8]}}",
            8, SS_EINVAL, "unknown dtype 'F12'");
    refused("{\"w\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[2],"
            "\"data_offsets\":[0,8]}}",
            8, SS_EINVAL, "duplicate key");
    refused("{\"w\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, SS_EINVAL,
            "exactly dtype, shape and data_offsets");
    refused("{\"v\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
            "\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
            12, SS_EINVAL, "tensors 'v' and 'w' overlap");
    refused("{\"v\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
            "\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}",
            20, SS_EINVAL, "(a hole)");
    refused("{\"v\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
            "\"v\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
            16, SS_EINVAL, "duplicate key 'v'");
    refused("{\"__metadata__\":{\"a\":1}}", 0, SS_EINVAL,
            "__metadata__ must map strings to strings");
    refused("{\"\\ud800\":1}", 0, SS_EINVAL, "lone high surrogate");
    refused("{\"a\x01\":1}", 0, SS_EINVAL, "control character");
    refused("{\"\xc0\xaf\":1}", 0, SS_EINVAL, "invalid UTF-8");
    refused("{\"it's\\\\\":1}", 0, SS_EINVAL, "tensor 'it\\'s\\\\':");
}

static void test_depth_and_prefix(void)
{
    char deep[200];
    uint8_t pre[8] = {16, 0, 0, 0, 0, 0, 0, 0};
    uint64_t n = 0;
    ss_errinfo e;
    refused("[[]", 0, SS_EINVAL, "not valid JSON");
    memset(deep, '[', 70);
    memset(deep + 70, ']', 70);
    deep[140] = '\0';
    refused(deep, 0, SS_EINVAL, "nested too deeply");
    ss_errinfo_clear(&e);
    CHECK_EQ_INT(ss_st_prefix(pre, 24, &n, &e), 0);
    CHECK_EQ_INT(n, 16);
    CHECK_EQ_INT(ss_st_prefix(pre, 23, &n, &e), SS_ERANGE);
    CHECK(strstr(e.detail, "reaches past the end") != NULL);
    pre[7] = 1;
    CHECK_EQ_INT(ss_st_prefix(pre, 1u << 30, &n, &e), SS_ERANGE);
    CHECK(strstr(e.detail, "exceeds the limit") != NULL);
}

int main(void)
{
    RUN(test_accepted);
    RUN(test_refused);
    RUN(test_depth_and_prefix);
    return ss_test_report("stheader");
}
