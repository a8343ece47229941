/* test_pkwrite.c - ss_pkwrite: the bytes of CPython's pickler (protocol 4,
 * Python 3.11), for ints of every form, floats, strings short, long and
 * past the frame target (written unframed), a frame too short for a
 * header, frames committed at save() boundaries past 64 KiB, BINGET and
 * LONG_BINGET, sticky errors; and the identity memo table. The expected
 * streams are pickle.dumps(...) of the values named (hex, or length and
 * CRC-32 for the long ones). */
#include "ss_crc.h"
#include "ss_pkwrite.h"
#include "ss_test.h"

#include <stdlib.h>
#include <string.h>

/* The writer's bytes equal the hex string. */
static int same_hex(const ss_pkw *w, const char *hex)
{
    size_t n, i;
    const unsigned char *p = ss_pkw_data(w, &n);
    if (strlen(hex) != 2 * n)
        return 0;
    for (i = 0; i < n; i++) {
        unsigned x;
        if (sscanf(hex + 2 * i, "%2x", &x) != 1 || x != p[i])
            return 0;
    }
    return 1;
}

static void test_int_forms(void)
{
    static const struct {
        int64_t v;
        const char *hex;
    } cases[] = {
        {0LL, "80044b002e"},
        {255LL, "80044bff2e"},
        {256LL, "80049504000000000000004d00012e"},
        {65535LL, "80049504000000000000004dffff2e"},
        {65536LL, "80049506000000000000004a000001002e"},
        {-1LL, "80049506000000000000004affffffff2e"},
        {2147483647LL, "80049506000000000000004affffff7f2e"},
        {-2147483648LL, "80049506000000000000004a000000802e"},
        {2147483648LL, "80049508000000000000008a0500000080002e"},
        {-2147483649LL, "80049508000000000000008a05ffffff7fff2e"},
        {9223372036854775807LL, "8004950b000000000000008a08ffffffffffffff7f2e"},
        {INT64_MIN, "8004950b000000000000008a0800000000000000802e"},
        {1099511627776LL, "80049509000000000000008a060000000000012e"},
        {-1099511627776LL, "80049509000000000000008a060000000000ff2e"},
        {128LL, "80044b802e"},
        {-128LL, "80049506000000000000004a80ffffff2e"},
        {-129LL, "80049506000000000000004a7fffffff2e"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        ss_pkw w;
        CHECK_EQ_INT(ss_pkw_init(&w, 0), 0);
        ss_pkw_start(&w);
        ss_pkw_boundary(&w);
        ss_pkw_int(&w, cases[i].v);
        CHECK_EQ_INT(ss_pkw_finish(&w), 0);
        if (!same_hex(&w, cases[i].hex))
            fprintf(stderr, "  int %lld\n", (long long)cases[i].v);
        CHECK(same_hex(&w, cases[i].hex));
        ss_pkw_destroy(&w);
    }
}

static void test_float_and_short_frame(void)
{
    ss_pkw w;
    ss_pkw_init(&w, 0);
    ss_pkw_start(&w);
    ss_pkw_float(&w, 1.5);
    ss_pkw_finish(&w);
    CHECK(same_hex(&w, "8004950a00000000000000473ff80000000000002e"));
    ss_pkw_destroy(&w);

    /* pickle.dumps('ab', 4): a 5-byte frame keeps its header */
    ss_pkw_init(&w, 0);
    ss_pkw_start(&w);
    ss_pkw_str(&w, "ab", 2);
    ss_pkw_memoize(&w, NULL);
    ss_pkw_finish(&w);
    CHECK(same_hex(&w, "80049506000000000000008c026162942e"));
    ss_pkw_destroy(&w);

    /* pickle.dumps(None, 4): 2 bytes, no frame header */
    ss_pkw_init(&w, 0);
    ss_pkw_start(&w);
    ss_pkw_op(&w, SS_PK_NONE);
    ss_pkw_finish(&w);
    CHECK(same_hex(&w, "80044e2e"));
    ss_pkw_destroy(&w);
}

static uint32_t crc_of(const ss_pkw *w, size_t *n)
{
    const unsigned char *p = ss_pkw_data(w, n);
    return ss_crc32(0, p, *n);
}

/* pickle.dumps(list(range(40000)), 4): save() boundaries commit frames of
 * 64 KiB and more; APPENDS per 1000 items (no empty batch for lists). */
static void test_frames_at_boundaries(void)
{
    ss_pkw w;
    size_t n;
    const unsigned char *p;
    ss_pkw_init(&w, 0);
    ss_pkw_start(&w);
    ss_pkw_boundary(&w);
    ss_pkw_op(&w, SS_PK_EMPTY_LIST);
    ss_pkw_memoize(&w, NULL);
    ss_pkw_op(&w, SS_PK_MARK);
    for (int i = 0; i < 40000; i++) {
        ss_pkw_boundary(&w);
        ss_pkw_int(&w, i);
        if ((i + 1) % SS_PKW_BATCH == 0) {
            ss_pkw_op(&w, SS_PK_APPENDS);
            if (i + 1 < 40000)
                ss_pkw_op(&w, SS_PK_MARK);
        }
    }
    CHECK_EQ_INT(ss_pkw_finish(&w), 0);
    CHECK_EQ_INT(crc_of(&w, &n), 0x90aff8b8u);
    CHECK_EQ_INT(n, 119847);
    p = ss_pkw_data(&w, &n);
    CHECK_EQ_INT(p[2], 0x95);
    uint64_t flen = 0;
    for (int i = 0; i < 8; i++)
        flen |= (uint64_t)p[3 + i] << (8 * i);
    CHECK(flen >= SS_PKW_FRAME_TARGET && flen < SS_PKW_FRAME_TARGET + 16);
    CHECK_EQ_INT(p[11 + flen], 0x95); /* the next frame follows */
    ss_pkw_destroy(&w);
}

/* pickle.dumps(['a' * 70000, 'b' * 300, 'c'], 4): the 3-byte first frame
 * loses its header, the long string goes out unframed, BINUNICODE for
 * 300 bytes, a new frame after it. */
static void test_long_strings(void)
{
    ss_pkw w;
    size_t n;
    char *a = malloc(70000), *b = malloc(300);
    memset(a, 'a', 70000);
    memset(b, 'b', 300);
    ss_pkw_init(&w, 0);
    ss_pkw_start(&w);
    ss_pkw_boundary(&w);
    ss_pkw_op(&w, SS_PK_EMPTY_LIST);
    ss_pkw_memoize(&w, NULL);
    ss_pkw_op(&w, SS_PK_MARK);
    ss_pkw_boundary(&w);
    ss_pkw_str(&w, a, 70000);
    ss_pkw_memoize(&w, NULL);
    ss_pkw_boundary(&w);
    ss_pkw_str(&w, b, 300);
    ss_pkw_memoize(&w, NULL);
    ss_pkw_boundary(&w);
    ss_pkw_str(&w, "c", 1);
    ss_pkw_memoize(&w, NULL);
    ss_pkw_op(&w, SS_PK_APPENDS);
    CHECK_EQ_INT(ss_pkw_finish(&w), 0);
    CHECK_EQ_INT(crc_of(&w, &n), 0x8ff38ca0u);
    CHECK_EQ_INT(n, 70332);
    const unsigned char *p = ss_pkw_data(&w, &n);
    CHECK(memcmp(p, "\x80\x04\x5d\x94\x28\x58\x70\x11\x01\x00", 10) == 0);
    ss_pkw_destroy(&w);
    free(a);
    free(b);
}

static void test_gets_and_sticky_error(void)
{
    ss_pkw w;
    uint32_t idx = 0;
    size_t n;
    ss_pkw_init(&w, 0);
    ss_pkw_start(&w);
    for (int i = 0; i < 300; i++) {
        ss_pkw_op(&w, SS_PK_NONE);
        ss_pkw_memoize(&w, &idx);
    }
    CHECK_EQ_INT(idx, 299);
    size_t before = w.len;
    CHECK_EQ_INT(ss_pkw_get(&w, 5), 0);
    CHECK_EQ_INT(ss_pkw_get(&w, 299), 0);
    const unsigned char *p = ss_pkw_data(&w, &n);
    CHECK(memcmp(p + before, "h\x05j\x2b\x01\x00\x00", 7) == 0);
    CHECK_EQ_INT(ss_pkw_get(&w, 300), SS_EINVAL); /* never memoized */
    CHECK_EQ_INT(w.err.code, SS_EINVAL);
    before = w.len;
    CHECK_EQ_INT(ss_pkw_int(&w, 1), SS_EINVAL); /* sticky: nothing written */
    CHECK_EQ_INT(ss_pkw_finish(&w), SS_EINVAL);
    CHECK_EQ_INT(w.len, before);
    ss_pkw_destroy(&w);
    ss_pkw_destroy(NULL);
}

static void test_memo_table(void)
{
    ss_pkmemo m;
    uint32_t v;
    size_t pos = 0, count = 0;
    uintptr_t key, sum = 0;
    CHECK_EQ_INT(ss_pkmemo_init(&m), 0);
    for (uint32_t i = 0; i < 100000; i++)
        CHECK_EQ_INT(ss_pkmemo_put(&m, (uintptr_t)(i + 1) * 16, i), 0);
    for (uint32_t i = 0; i < 100000; i += 7) {
        CHECK_EQ_INT(ss_pkmemo_get(&m, (uintptr_t)(i + 1) * 16, &v), 1);
        CHECK_EQ_INT(v, i);
    }
    CHECK_EQ_INT(ss_pkmemo_get(&m, 8, &v), 0);
    CHECK_EQ_INT(ss_pkmemo_get(&m, (uintptr_t)100001 * 16, &v), 0);
    while (ss_pkmemo_next(&m, &pos, &key)) {
        count++;
        sum += key / 16;
    }
    CHECK_EQ_INT(count, 100000);
    CHECK_EQ_INT(sum, (uintptr_t)100000 * 100001 / 2);
    ss_pkmemo_destroy(&m);
    ss_pkmemo_destroy(NULL);
}

int main(void)
{
    RUN(test_int_forms);
    RUN(test_float_and_short_frame);
    RUN(test_frames_at_boundaries);
    RUN(test_long_strings);
    RUN(test_gets_and_sticky_error);
    RUN(test_memo_table);
    return ss_test_report("pkwrite");
}
