/* test_crc.c - CRC-32 and CRC-32C: known vectors, every implementation
 * against a bit-at-a-time reference at every length 0..300 and alignment
 * 0..15 (plus lengths around each implementation's block thresholds), the
 * generated folding and shift constants against published values, and
 * combine. */
#include "ss_crc.h"
#include "ss_crc_internal.h"
#include "ss_test.h"

#include <stdlib.h>
#include <string.h>

typedef uint32_t (*crc_fn)(uint32_t, const void *, size_t);

/* The definition, one bit at a time. */
static uint32_t ref_crc(uint32_t poly, uint32_t crc, const void *buf,
                        size_t len)
{
    const unsigned char *p = buf;
    crc = ~crc;
    while (len--) {
        crc ^= *p++;
        for (int k = 0; k < 8; k++)
            crc = (crc >> 1) ^ (poly & (0u - (crc & 1u)));
    }
    return ~crc;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15u;

static uint32_t rnd32(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}

static unsigned char *random_buf(size_t n)
{
    unsigned char *b = malloc(n ? n : 1);
    for (size_t i = 0; i < n; i++)
        b[i] = (unsigned char)rnd32();
    return b;
}

#if defined(SS__CRC_X86)
static uint32_t crc32_pclmul(uint32_t c, const void *b, size_t n)
{
    ss__crc_fold k;
    ss__crc_fold_init(&k, SS__CRC32_POLY);
    return ss__crc_pclmul(c, b, n, &k, ss__crc32_portable);
}
static uint32_t crc32_vpclmul(uint32_t c, const void *b, size_t n)
{
    ss__crc_fold k;
    ss__crc_fold_init(&k, SS__CRC32_POLY);
    return ss__crc_vpclmul(c, b, n, &k, ss__crc32_portable);
}
/* The folding code is generic over the polynomial; check it on CRC-32C
 * too, which also checks the constant generator for a second P. */
static uint32_t crc32c_pclmul(uint32_t c, const void *b, size_t n)
{
    ss__crc_fold k;
    ss__crc_fold_init(&k, SS__CRC32C_POLY);
    return ss__crc_pclmul(c, b, n, &k, ss__crc32c_portable);
}
static uint32_t crc32c_vpclmul(uint32_t c, const void *b, size_t n)
{
    ss__crc_fold k;
    ss__crc_fold_init(&k, SS__CRC32C_POLY);
    return ss__crc_vpclmul(c, b, n, &k, ss__crc32c_portable);
}
#endif

typedef struct {
    const char *name;
    crc_fn fn;
    uint32_t poly;
    int usable;
} impl;

static size_t impls(impl *out)
{
    size_t n = 0;
    out[n++] = (impl){"crc32", ss_crc32, SS__CRC32_POLY, 1};
    out[n++] = (impl){"crc32c", ss_crc32c, SS__CRC32C_POLY, 1};
    out[n++] = (impl){"crc32 portable", ss__crc32_portable, SS__CRC32_POLY, 1};
    out[n++] =
        (impl){"crc32c portable", ss__crc32c_portable, SS__CRC32C_POLY, 1};
#if defined(SS__CRC_X86)
    __builtin_cpu_init();
    int pcl =
        __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
    int vpcl = pcl && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("vpclmulqdq");
    int sse42 = __builtin_cpu_supports("sse4.2");
    out[n++] = (impl){"crc32 pclmul", crc32_pclmul, SS__CRC32_POLY, pcl};
    out[n++] = (impl){"crc32 vpclmul", crc32_vpclmul, SS__CRC32_POLY, vpcl};
    out[n++] = (impl){"crc32c pclmul", crc32c_pclmul, SS__CRC32C_POLY, pcl};
    out[n++] = (impl){"crc32c vpclmul", crc32c_vpclmul, SS__CRC32C_POLY, vpcl};
    out[n++] = (impl){"crc32c sse42", ss__crc32c_sse42, SS__CRC32C_POLY, sse42};
    out[n++] = (impl){"crc32c sse42-3way", ss__crc32c_sse42_3way,
                      SS__CRC32C_POLY, sse42 && pcl};
#endif
    return n;
}

static void test_known_vectors(void)
{
    unsigned char zeros[32] = {0}, ones[32], asc[32];
    memset(ones, 0xFF, sizeof ones);
    for (int i = 0; i < 32; i++)
        asc[i] = (unsigned char)i;

    CHECK_EQ_INT(ss_crc32(0, "123456789", 9), 0xCBF43926u);
    CHECK_EQ_INT(ss_crc32(0, "", 0), 0);
    CHECK_EQ_INT(ss_crc32(0x12345678u, "", 0), 0x12345678u);
    CHECK_EQ_INT(ss_crc32(0, "The quick brown fox jumps over the lazy dog", 43),
                 0x414FA339u);
    /* RFC 3720 (iSCSI) B.4. */
    CHECK_EQ_INT(ss_crc32c(0, "123456789", 9), 0xE3069283u);
    CHECK_EQ_INT(ss_crc32c(0, zeros, 32), 0x8A9136AAu);
    CHECK_EQ_INT(ss_crc32c(0, ones, 32), 0x62A8AB43u);
    CHECK_EQ_INT(ss_crc32c(0, asc, 32), 0x46DD794Eu);
    CHECK_EQ_INT(ss_crc32c(0, "", 0), 0);
    /* An empty buffer may be NULL. */
    CHECK_EQ_INT(ss_crc32(0x12345678u, NULL, 0), 0x12345678u);
    CHECK_EQ_INT(ss_crc32c(0x12345678u, NULL, 0), 0x12345678u);
}

/* Every implementation, every length 0..300 at every alignment 0..15,
 * with a random running value. */
static void test_all_lengths_alignments(void)
{
    impl im[16];
    size_t n = impls(im);
    unsigned char *buf = random_buf(300 + 16);

    for (size_t i = 0; i < n; i++) {
        if (!im[i].usable)
            continue;
        int bad = 0;
        for (size_t off = 0; off < 16; off++)
            for (size_t len = 0; len <= 300; len++) {
                uint32_t v = rnd32();
                uint32_t want = ref_crc(im[i].poly, v, buf + off, len);
                uint32_t got = im[i].fn(v, buf + off, len);
                if (got != want && bad++ < 3)
                    fprintf(stderr, "  %s off=%zu len=%zu: %08x != %08x\n",
                            im[i].name, off, len, got, want);
            }
        CHECK_EQ_INT(bad, 0);
    }
    free(buf);
}

/* Lengths around the 256/1024-byte folding thresholds and the 3 x 256 and
 * 3 x 8192 CRC-32C blocks, at a few alignments; the buffer is exactly len
 * bytes long so ASan sees any read past the end. */
static void test_threshold_lengths(void)
{
    static const size_t base[] = {511,   512,   1023,  1024,  1025,  1279,
                                  1280,  2048,  2303,  3071,  4096,  4111,
                                  767,   768,   769,   1535,  1536,  2304,
                                  24575, 24576, 24577, 49152, 50000, 100003};
    impl im[16];
    size_t n = impls(im);

    for (size_t b = 0; b < sizeof base / sizeof *base; b++)
        for (size_t off = 0; off < 4; off++) {
            size_t len = base[b] + off * 5;
            unsigned char *mem = random_buf(len + off);
            const unsigned char *p = mem + off;
            uint32_t want32 = ref_crc(SS__CRC32_POLY, 7, p, len);
            uint32_t want32c = ref_crc(SS__CRC32C_POLY, 7, p, len);
            for (size_t i = 0; i < n; i++) {
                if (!im[i].usable)
                    continue;
                uint32_t want = im[i].poly == SS__CRC32_POLY ? want32 : want32c;
                uint32_t got = im[i].fn(7, p, len);
                if (got != want)
                    fprintf(stderr, "  %s len=%zu off=%zu\n", im[i].name, len,
                            off);
                CHECK(got == want);
            }
            free(mem);
        }
}

/* The generator reproduces the constants published with linux's
 * crc32-pclmul (and the Intel paper) for the zlib polynomial, and the
 * 3-stream shift constants compiled into ss_crc_x86.c. */
static void test_constants(void)
{
    ss__crc_fold k;
    ss__crc_fold_init(&k, SS__CRC32_POLY);
    CHECK(k.fold512[0] == 0x154442bd4u);
    CHECK(k.fold512[1] == 0x1c6e41596u);
    CHECK(k.fold128[0] == 0x1751997d0u);
    CHECK(k.fold128[1] == 0x0ccaa009eu);
    CHECK(k.k64[0] == 0x163cd6124u);
    CHECK(k.poly_mu[0] == 0x1db710641u);
    CHECK(k.poly_mu[1] == 0x1f7011641u);
    /* x^0, x^31 and x^32 mod P (reflected). */
    CHECK_EQ_INT(ss__crc_xpow(SS__CRC32_POLY, 0), 0x80000000u);
    CHECK_EQ_INT(ss__crc_xpow(SS__CRC32_POLY, 31), 1);
    CHECK_EQ_INT(ss__crc_xpow(SS__CRC32_POLY, 32), SS__CRC32_POLY);
#if defined(SS__CRC_X86)
    CHECK_EQ_INT(ss__crc32c_shift_long,
                 ss__crc_xpow(SS__CRC32C_POLY, 8 * SS__CRC32C_LONG - 33));
    CHECK_EQ_INT(ss__crc32c_shift_short,
                 ss__crc_xpow(SS__CRC32C_POLY, 8 * SS__CRC32C_SHORT - 33));
#endif
}

static void test_combine(void)
{
    size_t n = 5000;
    unsigned char *buf = random_buf(n);

    for (int r = 0; r < 200; r++) {
        size_t cut = rnd32() % (n + 1);
        uint32_t a32 = ss_crc32(0, buf, cut), a32c = ss_crc32c(0, buf, cut);
        uint32_t b32 = ss_crc32(0, buf + cut, n - cut);
        uint32_t b32c = ss_crc32c(0, buf + cut, n - cut);
        CHECK_EQ_INT(ss_crc32_combine(a32, b32, n - cut), ss_crc32(0, buf, n));
        CHECK_EQ_INT(ss_crc32c_combine(a32c, b32c, n - cut),
                     ss_crc32c(0, buf, n));
    }
    /* len2 == 0 leaves crc1 alone (crc of nothing is 0). */
    CHECK_EQ_INT(ss_crc32_combine(0xDEADBEEFu, 0, 0), 0xDEADBEEFu);
    CHECK_EQ_INT(ss_crc32c_combine(0xDEADBEEFu, 0, 0), 0xDEADBEEFu);
    /* Huge lengths: extending a one-byte message by a zeros and then b zero
     * bytes equals extending it by a + b at once; the two routes multiply
     * different table entries. */
    uint64_t big[] = {1ull << 40, (1ull << 62) + 12345, ~0ull >> 1, ~0ull};
    uint32_t one32 = ss_crc32(0, "x", 1), one32c = ss_crc32c(0, "x", 1);
    for (size_t i = 0; i < sizeof big / sizeof *big; i++) {
        uint64_t a = big[i] / 3, b = big[i] - a;
        uint32_t za = ss_crc32_combine(one32, ss_crc32_combine(0, 0, a), a);
        CHECK_EQ_INT(
            ss_crc32_combine(za, ss_crc32_combine(0, 0, b), b),
            ss_crc32_combine(one32, ss_crc32_combine(0, 0, a + b), a + b));
        uint32_t zc = ss_crc32c_combine(one32c, ss_crc32c_combine(0, 0, a), a);
        CHECK_EQ_INT(
            ss_crc32c_combine(zc, ss_crc32c_combine(0, 0, b), b),
            ss_crc32c_combine(one32c, ss_crc32c_combine(0, 0, a + b), a + b));
    }
    free(buf);
}

static void test_force_portable(void)
{
    CHECK_EQ_INT(ss_crc_force_portable(1), 0);
    CHECK(strcmp(ss_crc32_impl(), "portable") == 0);
    CHECK(strcmp(ss_crc32c_impl(), "portable") == 0);
    CHECK_EQ_INT(ss_crc32(0, "123456789", 9), 0xCBF43926u);
    CHECK_EQ_INT(ss_crc_force_portable(0), 1);
#if defined(SS__CRC_X86)
    if (__builtin_cpu_supports("pclmul"))
        CHECK(strcmp(ss_crc32_impl(), "portable") != 0);
    if (__builtin_cpu_supports("sse4.2"))
        CHECK(strcmp(ss_crc32c_impl(), "portable") != 0);
#endif
}

int main(void)
{
    RUN(test_known_vectors);
    RUN(test_all_lengths_alignments);
    RUN(test_threshold_lengths);
    RUN(test_constants);
    RUN(test_combine);
    RUN(test_force_portable);
    return ss_test_report("crc");
}
