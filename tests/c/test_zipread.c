/* test_zipread.c - ss_zipread_tensor on torch.save records of the seed
 * corpus (tests/fuzz/corpus/records, read from the repository root, where
 * make runs the tests): what it recognises, and that every truncation and
 * byte change of the zip structures is refused or recognised the same way,
 * never read out of bounds (this program runs under ASan). */
#include "ss_crc.h"
#include "ss_test.h"
#include "ss_zipread.h"

#include <stdlib.h>
#include <string.h>

static unsigned char *load(const char *name, size_t *len)
{
    char path[256];
    unsigned char *b = NULL;
    FILE *f;
    long n;
    snprintf(path, sizeof path, "tests/fuzz/corpus/records/%s.rec", name);
    f = fopen(path, "rb");
    CHECK(f != NULL);
    if (f == NULL)
        return NULL;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    b = malloc((size_t)n);
    CHECK(b != NULL && fread(b, 1, (size_t)n, f) == (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return b;
}

static void test_recognised(void)
{
    size_t len = 0;
    ss_zip_tensor t;
    ss_errinfo e;
    unsigned char *b = load("tensor_f32_strided", &len);

    CHECK_EQ_INT(ss_zipread_tensor(b, len, &t, &e), 0);
    CHECK(strcmp(t.dtype, "float32") == 0);
    CHECK_EQ_INT(t.ndim, 2);
    CHECK(t.shape[0] == 4 && t.shape[1] == 3);
    CHECK(t.stride[0] == 1 && t.stride[1] == 4);
    CHECK_EQ_INT(t.storage_numel, 12);
    CHECK_EQ_INT(t.data_length, 48);
    CHECK(t.data_offset + t.data_length <= len);
    CHECK_EQ_INT(ss_crc32(0, b + t.data_offset, t.data_length), t.data_crc32);
    free(b);

    b = load("tensor_c64_conj", &len);
    CHECK_EQ_INT(ss_zipread_tensor(b, len, &t, &e), 0);
    CHECK(strcmp(t.dtype, "complex64") == 0 && t.conj && !t.neg);
    free(b);
    b = load("tensor_f32_offset", &len);
    CHECK_EQ_INT(ss_zipread_tensor(b, len, &t, &e), 0);
    CHECK_EQ_INT(t.storage_offset, 5);
    free(b);
    b = load("tensor_f8_v3", &len); /* _rebuild_tensor_v3 */
    CHECK_EQ_INT(ss_zipread_tensor(b, len, &t, &e), 0);
    CHECK(strcmp(t.dtype, "float8_e4m3fn") == 0 && t.itemsize == 1);
    free(b);
    b = load("tensor_i8_empty", &len);
    CHECK_EQ_INT(ss_zipread_tensor(b, len, &t, &e), 0);
    CHECK(t.shape[0] == 0 && t.data_length == 0);
    free(b);
}

static void test_truncated_and_changed(void)
{
    size_t len = 0;
    ss_zip_tensor t, ref;
    ss_errinfo e;
    unsigned char *b = load("tensor_f32_strided", &len), *c;

    CHECK_EQ_INT(ss_zipread_tensor(b, len, &ref, &e), 0);
    for (size_t k = 0; k < len;
         k++) { /* exact-size copies: ASan sees overruns */
        c = malloc(k ? k : 1);
        memcpy(c, b, k);
        CHECK_EQ_INT(ss_zipread_tensor(c, k, &t, &e), SS_EINVAL);
        free(c);
    }
    CHECK_EQ_INT(ss_zipread_tensor(b, 50, &t, &e), SS_EINVAL);
    CHECK(strstr(e.detail, "too short") != NULL);
    c = malloc(len);
    for (size_t k = 0; k < len; k++) {
        if (k >= ref.data_offset && k < ref.data_offset + ref.data_length)
            continue; /* the storage bytes are not the parser's */
        for (int bit = 0; bit < 8; bit += 3) {
            int rc;
            memcpy(c, b, len);
            c[k] ^= (unsigned char)(1u << bit);
            rc = ss_zipread_tensor(c, len, &t, &e);
            CHECK(rc == 0 || rc == SS_EINVAL);
            if (rc == 0) /* an unchecked byte (a name's unused field...) */
                CHECK(t.data_offset == ref.data_offset &&
                      t.data_length == ref.data_length &&
                      t.data_crc32 == ref.data_crc32);
        }
    }
    free(c);
    free(b);
}

int main(void)
{
    RUN(test_recognised);
    RUN(test_truncated_and_changed);
    return ss_test_report("zipread");
}
