/* ss_crc.c - CRC-32 and CRC-32C: the portable implementation, the
 * combine functions, the constant generator and the run-time dispatch.
 *
 * Portable code: slicing-by-16 over tables built once (pthread_once); it
 * reads 4-byte words assembled byte by byte, so it is correct on any
 * byte order and alignment (the compiler turns the assembly into one load
 * on little-endian machines).
 *
 * Dispatch: on first use, one pthread_once picks the fastest implementation
 * the CPU supports (ss_crc_x86.c) and stores it in two function pointers,
 * which never change afterwards. ss_crc_force_portable() makes every call
 * take the portable code instead; it is for tests, which use it to check
 * both paths on one machine.
 *
 * Combine: crc(A || B) = crc(A) * x^(8 len(B)) + crc(B) mod P. x^(8n) is a
 * product of entries of a table of x^(2^k) mod P, so a combine costs one
 * GF(2) multiply (32 shift-and-xor steps) per set bit of len(B), plus one.
 *
 * Invariants: all tables and pointers are written only inside init_once and
 * read only after it (pthread_once orders the two).
 * Thread safety: every function is reentrant. The force-portable switch is
 * an atomic, so flipping it while other threads checksum is safe; they get
 * the same values either way, only the speed changes.
 */
#include "ss_crc.h"

#include "ss_crc_internal.h"

#include <pthread.h>
#include <stdatomic.h>

typedef uint32_t (*crc_fn)(uint32_t, const void *, size_t);

/* tab[k][b]: the CRC register contribution of byte b followed by k zero
 * bytes; tab[0] is the classic byte-at-a-time table. */
static uint32_t tab32[16][256], tab32c[16][256];
/* pow2[k] = x^(2^k) mod P, reflected, for k < 64 + 3: combine multiplies
 * by x^(8 n) for any n < 2^64. */
#define POW2_N 67
static uint32_t pow2_32[POW2_N], pow2_32c[POW2_N];
static ss__crc_fold fold32, fold32c;

static crc_fn crc32_fast = ss__crc32_portable;
static crc_fn crc32c_fast = ss__crc32c_portable;
static const char *crc32_name = "portable";
static const char *crc32c_name = "portable";

static pthread_once_t init_once_ctl = PTHREAD_ONCE_INIT;
static atomic_int force_portable;

/* ---- GF(2) arithmetic modulo a reflected polynomial -------------------- */

/* a * b mod P. Reflected: bit 31 is x^0, bit 0 is x^31. */
static uint32_t gf2_mul(uint32_t a, uint32_t b, uint32_t poly)
{
    uint32_t m = 1u << 31, p = 0;
    while (a) {
        if (a & m) {
            p ^= b;
            a ^= m;
        }
        m >>= 1;
        b = (b >> 1) ^ (poly & (0u - (b & 1u)));
    }
    return p;
}

static void build_pow2(uint32_t *pow2, uint32_t poly)
{
    pow2[0] = 1u << 30; /* x^1 */
    for (int k = 1; k < POW2_N; k++)
        pow2[k] = gf2_mul(pow2[k - 1], pow2[k - 1], poly);
}

/* x^n mod P from a pow2 table: one multiply per set bit of n. */
static uint32_t xpow_tab(const uint32_t *pow2, uint64_t n, uint32_t poly)
{
    uint32_t r = 1u << 31; /* x^0 */
    for (int k = 0; n; k++, n >>= 1)
        if (n & 1)
            r = gf2_mul(r, pow2[k], poly);
    return r;
}

uint32_t ss__crc_xpow(uint32_t poly, uint64_t n)
{
    uint32_t pow2[POW2_N];
    build_pow2(pow2, poly);
    return xpow_tab(pow2, n, poly);
}

static uint32_t reverse32(uint32_t v)
{
    uint32_t r = 0;
    for (int i = 0; i < 32; i++, v >>= 1)
        r = (r << 1) | (v & 1u);
    return r;
}

/* The folding step multiplies 64-bit halves by x^n mod P in the form
 * reflect(x^n mod P) << 1: bit b then stands for x^(32-b), which is what
 * makes a 64x33-bit carry-less product land at the right degree. */
static uint64_t fold_const(uint32_t poly, uint64_t n)
{
    return (uint64_t)ss__crc_xpow(poly, n) << 1;
}

/* Reverse 33 bits: bit j goes to bit 32 - j. */
static uint64_t reverse33(uint64_t v)
{
    return ((uint64_t)reverse32((uint32_t)v) << 1) | (v >> 32 & 1u);
}

void ss__crc_fold_init(ss__crc_fold *k, uint32_t poly)
{
    /* P in normal order, 33 bits (bit 32 is x^32). */
    uint64_t p = ((uint64_t)1 << 32) | reverse32(poly);
    uint64_t rem = 0, mu = 0;

    /* mu = floor(x^64 / P) by long division: bring in the dividend's bits
     * from x^64 down to x^0; whenever the remainder reaches degree 32,
     * subtract P * x^i and set quotient bit i. */
    for (int i = 64; i >= 0; i--) {
        rem = (rem << 1) | (uint64_t)(i == 64);
        if (rem >> 32) {
            rem ^= p;
            mu |= (uint64_t)1 << i;
        }
    }
    k->fold2048[0] = fold_const(poly, 2048 + 32);
    k->fold2048[1] = fold_const(poly, 2048 - 32);
    k->fold512[0] = fold_const(poly, 512 + 32);
    k->fold512[1] = fold_const(poly, 512 - 32);
    k->fold128[0] = fold_const(poly, 128 + 32);
    k->fold128[1] = fold_const(poly, 128 - 32);
    k->k64[0] = fold_const(poly, 64);
    k->k64[1] = 0;
    k->poly_mu[0] = reverse33(p);
    k->poly_mu[1] = reverse33(mu);
}

/* ---- portable slicing-by-16 ------------------------------------------ */

static void build_tables(uint32_t tab[16][256], uint32_t poly)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (poly & (0u - (c & 1u)));
        tab[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int k = 1; k < 16; k++)
            tab[k][i] = (tab[k - 1][i] >> 8) ^ tab[0][tab[k - 1][i] & 0xFFu];
}

static inline uint32_t le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
           (uint32_t)p[3] << 24;
}

static uint32_t slice16(const uint32_t tab[16][256], uint32_t crc,
                        const void *buf, size_t len)
{
    const unsigned char *p = buf;

    crc = ~crc;
    while (len >= 16) {
        uint32_t w0 = le32(p) ^ crc, w1 = le32(p + 4), w2 = le32(p + 8),
                 w3 = le32(p + 12);
        crc = tab[15][w0 & 0xFFu] ^ tab[14][(w0 >> 8) & 0xFFu] ^
              tab[13][(w0 >> 16) & 0xFFu] ^ tab[12][w0 >> 24] ^
              tab[11][w1 & 0xFFu] ^ tab[10][(w1 >> 8) & 0xFFu] ^
              tab[9][(w1 >> 16) & 0xFFu] ^ tab[8][w1 >> 24] ^
              tab[7][w2 & 0xFFu] ^ tab[6][(w2 >> 8) & 0xFFu] ^
              tab[5][(w2 >> 16) & 0xFFu] ^ tab[4][w2 >> 24] ^
              tab[3][w3 & 0xFFu] ^ tab[2][(w3 >> 8) & 0xFFu] ^
              tab[1][(w3 >> 16) & 0xFFu] ^ tab[0][w3 >> 24];
        p += 16;
        len -= 16;
    }
    while (len--)
        crc = (crc >> 8) ^ tab[0][(crc ^ *p++) & 0xFFu];
    return ~crc;
}

static void init_once(void);

uint32_t ss__crc32_portable(uint32_t crc, const void *buf, size_t len)
{
    pthread_once(&init_once_ctl, init_once);
    return slice16((const uint32_t (*)[256])tab32, crc, buf, len);
}

uint32_t ss__crc32c_portable(uint32_t crc, const void *buf, size_t len)
{
    pthread_once(&init_once_ctl, init_once);
    return slice16((const uint32_t (*)[256])tab32c, crc, buf, len);
}

/* ---- dispatch --------------------------------------------------------- */

#if defined(SS__CRC_X86)
static uint32_t crc32_pclmul(uint32_t crc, const void *buf, size_t len)
{
    return ss__crc_pclmul(crc, buf, len, &fold32, ss__crc32_portable);
}

static uint32_t crc32_vpclmul(uint32_t crc, const void *buf, size_t len)
{
    return ss__crc_vpclmul(crc, buf, len, &fold32, ss__crc32_portable);
}

/* With 512-bit folding, CRC-32C runs ~2.5x faster than three crc32
 * streams on cached data; short buffers and the tails stay on crc32. */
static uint32_t crc32c_vpclmul(uint32_t crc, const void *buf, size_t len)
{
    if (len < SS__CRC_VPCLMUL_MIN)
        return ss__crc32c_sse42_3way(crc, buf, len);
    return ss__crc_vpclmul(crc, buf, len, &fold32c, ss__crc32c_sse42);
}
#endif

static void init_once(void)
{
    build_tables(tab32, SS__CRC32_POLY);
    build_tables(tab32c, SS__CRC32C_POLY);
    build_pow2(pow2_32, SS__CRC32_POLY);
    build_pow2(pow2_32c, SS__CRC32C_POLY);
    ss__crc_fold_init(&fold32, SS__CRC32_POLY);
    ss__crc_fold_init(&fold32c, SS__CRC32C_POLY);
#if defined(SS__CRC_X86)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1")) {
        crc32_fast = crc32_pclmul;
        crc32_name = "pclmul";
        if (__builtin_cpu_supports("avx512f") &&
            __builtin_cpu_supports("vpclmulqdq")) {
            crc32_fast = crc32_vpclmul;
            crc32_name = "vpclmul";
        }
    }
    if (__builtin_cpu_supports("sse4.2")) {
        crc32c_fast = ss__crc32c_sse42;
        crc32c_name = "sse42";
        if (__builtin_cpu_supports("pclmul")) {
            crc32c_fast = ss__crc32c_sse42_3way;
            crc32c_name = "sse42-3way";
        }
        if (crc32_fast == crc32_vpclmul) {
            crc32c_fast = crc32c_vpclmul;
            crc32c_name = "vpclmul+sse42";
        }
    }
#endif
}

uint32_t ss_crc32(uint32_t crc, const void *buf, size_t len)
{
    pthread_once(&init_once_ctl, init_once);
    if (atomic_load_explicit(&force_portable, memory_order_relaxed))
        return ss__crc32_portable(crc, buf, len);
    return crc32_fast(crc, buf, len);
}

uint32_t ss_crc32c(uint32_t crc, const void *buf, size_t len)
{
    pthread_once(&init_once_ctl, init_once);
    if (atomic_load_explicit(&force_portable, memory_order_relaxed))
        return ss__crc32c_portable(crc, buf, len);
    return crc32c_fast(crc, buf, len);
}

int ss_crc_force_portable(int on)
{
    return atomic_exchange(&force_portable, on != 0);
}

const char *ss_crc32_impl(void)
{
    pthread_once(&init_once_ctl, init_once);
    return atomic_load(&force_portable) ? "portable" : crc32_name;
}

const char *ss_crc32c_impl(void)
{
    pthread_once(&init_once_ctl, init_once);
    return atomic_load(&force_portable) ? "portable" : crc32c_name;
}

/* ---- combine ------------------------------------------------------------ */

uint32_t ss_crc32_combine(uint32_t crc1, uint32_t crc2, uint64_t len2)
{
    pthread_once(&init_once_ctl, init_once);
    /* x^(8 n) = product of x^(2^(k+3)) over the set bits k of n; indexing
     * the table from 3 avoids computing 8 n, which may overflow. */
    uint32_t r = 1u << 31;
    for (int k = 3; len2; k++, len2 >>= 1)
        if (len2 & 1)
            r = gf2_mul(r, pow2_32[k], SS__CRC32_POLY);
    return gf2_mul(r, crc1, SS__CRC32_POLY) ^ crc2;
}

uint32_t ss_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2)
{
    pthread_once(&init_once_ctl, init_once);
    uint32_t r = 1u << 31;
    for (int k = 3; len2; k++, len2 >>= 1)
        if (len2 & 1)
            r = gf2_mul(r, pow2_32c[k], SS__CRC32C_POLY);
    return gf2_mul(r, crc1, SS__CRC32C_POLY) ^ crc2;
}
