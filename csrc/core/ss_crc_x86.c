/* ss_crc_x86.c - x86-64 accelerated CRC-32 and CRC-32C.
 *
 * CRC-32 (any reflected polynomial, given its ss__crc_fold constants):
 * carry-less multiply folding as in Intel's "Fast CRC Computation for
 * Generic Polynomials Using PCLMULQDQ" (the scheme of zlib-ng, Chromium and
 * linux crc32-pclmul). Four 128-bit accumulators (or four 512-bit ones with
 * VPCLMULQDQ) are folded forward over the data, folded down to one 128-bit
 * value, reduced to 64 bits and then to 32 by Barrett reduction. Tails
 * shorter than a block go to the portable code.
 *
 * CRC-32C: the SSE4.2 crc32 instruction has a 3-cycle latency but a
 * 1-per-cycle throughput, so large buffers are cut into three streams that
 * run interleaved and are recombined with a carry-less multiply "shift":
 * reg * x^(8n) mod P = crc32_u64(0, clmul(reg, x^(8n-33) mod P)).
 * Where VPCLMULQDQ exists, ss_crc.c runs large CRC-32C buffers through the
 * same folding code as CRC-32 (with CRC-32C constants) instead.
 *
 * Every function here is compiled with a target attribute and must only be
 * called after the dispatcher in ss_crc.c has checked the CPU features
 * named in ss_crc_internal.h. Loads are unaligned and stay inside
 * [buf, buf + len).
 *
 * Thread safety: pure functions of their arguments; reentrant.
 */
#include "ss_crc_internal.h"

#if defined(SS__CRC_X86)

#include <immintrin.h>
#include <string.h>

#define TARGET_PCLMUL __attribute__((target("pclmul,sse4.1")))
#define TARGET_VPCLMUL                                                         \
    __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.1")))
#define TARGET_SSE42 __attribute__((target("sse4.2")))
#define TARGET_SSE42_PCLMUL __attribute__((target("sse4.2,pclmul")))

/* How far ahead of the folding loops to prefetch. Buffers much larger than
 * the caches are limited by memory latency on one core; asking for lines
 * 4 KiB ahead measured ~25% faster on 256 MiB than leaving it to the
 * hardware prefetcher, and costs nothing in cache. Prefetches never fault,
 * so running past the end of the buffer is harmless. */
#define PREFETCH_AHEAD 4096
#define PREFETCH(p)                                                            \
    _mm_prefetch((const char *)(p) + PREFETCH_AHEAD, _MM_HINT_T0)

/* ---- carry-less multiply folding -------------------------------------- */

/* x * x^D mod P (not fully reduced), for the constants k of distance D. */
TARGET_PCLMUL static inline __m128i fold128(__m128i x, __m128i k)
{
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00),
                         _mm_clmulepi64_si128(x, k, 0x11));
}

/* Fold four consecutive 128-bit lanes into one, fold in the remaining
 * whole 16-byte blocks of p, and reduce. Returns the CRC register (not
 * inverted) of everything up to p + (*len & ~15); advances p and len. */
TARGET_PCLMUL static inline uint32_t
fold_finish(__m128i x1, __m128i x2, __m128i x3, __m128i x4,
            const unsigned char **pp, size_t *plen, const ss__crc_fold *k)
{
    const unsigned char *p = *pp;
    size_t len = *plen;
    const __m128i k128 = _mm_loadu_si128((const __m128i *)k->fold128);
    const __m128i mask32 = _mm_setr_epi32(-1, 0, -1, 0);
    __m128i t;

    x1 = _mm_xor_si128(fold128(x1, k128), x2);
    x1 = _mm_xor_si128(fold128(x1, k128), x3);
    x1 = _mm_xor_si128(fold128(x1, k128), x4);
    while (len >= 16) {
        x1 = _mm_xor_si128(fold128(x1, k128),
                           _mm_loadu_si128((const __m128i *)p));
        p += 16;
        len -= 16;
    }
    *pp = p;
    *plen = len;

    /* 128 -> 96 bits: the low half times x^96, into the high half. */
    t = _mm_clmulepi64_si128(x1, k128, 0x10);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), t);
    /* 96 -> 64 bits: the low 32 bits times x^64, into the rest. */
    t = _mm_srli_si128(x1, 4);
    x1 = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32),
                              _mm_loadl_epi64((const __m128i *)k->k64), 0x00);
    x1 = _mm_xor_si128(x1, t);
    /* Barrett: q = floor(r / P) via mu, r - q * P leaves the remainder in
     * bits 32..63. */
    const __m128i pm = _mm_loadu_si128((const __m128i *)k->poly_mu);
    t = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), pm, 0x10);
    t = _mm_clmulepi64_si128(_mm_and_si128(t, mask32), pm, 0x00);
    x1 = _mm_xor_si128(x1, t);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}

TARGET_PCLMUL uint32_t
ss__crc_pclmul(uint32_t crc, const void *buf, size_t len, const ss__crc_fold *k,
               uint32_t (*portable)(uint32_t, const void *, size_t))
{
    const unsigned char *p = buf;
    __m128i x1, x2, x3, x4, kk;
    uint32_t reg;

    if (len < 64)
        return portable(crc, buf, len);
    x1 = _mm_loadu_si128((const __m128i *)(p + 0));
    x2 = _mm_loadu_si128((const __m128i *)(p + 16));
    x3 = _mm_loadu_si128((const __m128i *)(p + 32));
    x4 = _mm_loadu_si128((const __m128i *)(p + 48));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)~crc));
    p += 64;
    len -= 64;

    kk = _mm_loadu_si128((const __m128i *)k->fold512);
    while (len >= 64) {
        PREFETCH(p);
        x1 = _mm_xor_si128(fold128(x1, kk),
                           _mm_loadu_si128((const __m128i *)(p + 0)));
        x2 = _mm_xor_si128(fold128(x2, kk),
                           _mm_loadu_si128((const __m128i *)(p + 16)));
        x3 = _mm_xor_si128(fold128(x3, kk),
                           _mm_loadu_si128((const __m128i *)(p + 32)));
        x4 = _mm_xor_si128(fold128(x4, kk),
                           _mm_loadu_si128((const __m128i *)(p + 48)));
        p += 64;
        len -= 64;
    }
    reg = fold_finish(x1, x2, x3, x4, &p, &len, k);
    return portable(~reg, p, len);
}

/* z * x^D mod P (not fully reduced) xor d, in each 128-bit lane. */
TARGET_VPCLMUL static inline __m512i fold512(__m512i z, __m512i k, __m512i d)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(z, k, 0x00),
                                     _mm512_clmulepi64_epi128(z, k, 0x11), d,
                                     0x96 /* a ^ b ^ c */);
}

TARGET_VPCLMUL uint32_t ss__crc_vpclmul(
    uint32_t crc, const void *buf, size_t len, const ss__crc_fold *k,
    uint32_t (*portable)(uint32_t, const void *, size_t))
{
    const unsigned char *p = buf;
    __m512i z0, z1, z2, z3, kk;
    uint32_t reg;

    /* Below a few blocks the 512-bit set-up does not pay. */
    if (len < SS__CRC_VPCLMUL_MIN)
        return ss__crc_pclmul(crc, buf, len, k, portable);
    z0 = _mm512_loadu_si512((const void *)(p + 0));
    z1 = _mm512_loadu_si512((const void *)(p + 64));
    z2 = _mm512_loadu_si512((const void *)(p + 128));
    z3 = _mm512_loadu_si512((const void *)(p + 192));
    z0 = _mm512_xor_si512(z0,
                          _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)~crc)));
    p += 256;
    len -= 256;

    kk = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)k->fold2048));
    while (len >= 256) {
        PREFETCH(p);
        PREFETCH(p + 64);
        PREFETCH(p + 128);
        PREFETCH(p + 192);
        z0 = fold512(z0, kk, _mm512_loadu_si512((const void *)(p + 0)));
        z1 = fold512(z1, kk, _mm512_loadu_si512((const void *)(p + 64)));
        z2 = fold512(z2, kk, _mm512_loadu_si512((const void *)(p + 128)));
        z3 = fold512(z3, kk, _mm512_loadu_si512((const void *)(p + 192)));
        p += 256;
        len -= 256;
    }
    /* Four 512-bit lanes -> one, then the remaining 64-byte blocks. */
    kk = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)k->fold512));
    z0 = fold512(z0, kk, z1);
    z0 = fold512(z0, kk, z2);
    z0 = fold512(z0, kk, z3);
    while (len >= 64) {
        z0 = fold512(z0, kk, _mm512_loadu_si512((const void *)p));
        p += 64;
        len -= 64;
    }
    reg = fold_finish(_mm512_extracti32x4_epi32(z0, 0),
                      _mm512_extracti32x4_epi32(z0, 1),
                      _mm512_extracti32x4_epi32(z0, 2),
                      _mm512_extracti32x4_epi32(z0, 3), &p, &len, k);
    return portable(~reg, p, len);
}

/* ---- CRC-32C with the crc32 instruction -------------------------------- */

/* x^(8 n - 33) mod P for P = CRC-32C and n = SS__CRC32C_LONG / _SHORT,
 * reflected; test_crc.c checks them against ss__crc_xpow(). */
const uint32_t ss__crc32c_shift_long = 0x54a86326u;
const uint32_t ss__crc32c_shift_short = 0xb9e02b86u;

static inline uint64_t load64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8); /* x86 is little-endian, as crc32 expects */
    return v;
}

/* One stream; takes and returns the register (not inverted). */
TARGET_SSE42 static uint32_t crc32c_stream(uint32_t reg, const unsigned char *p,
                                           size_t len)
{
    while (len >= 8) {
        reg = (uint32_t)_mm_crc32_u64(reg, load64(p));
        p += 8;
        len -= 8;
    }
    while (len--)
        reg = _mm_crc32_u8(reg, *p++);
    return reg;
}

TARGET_SSE42 uint32_t ss__crc32c_sse42(uint32_t crc, const void *buf,
                                       size_t len)
{
    return ~crc32c_stream(~crc, buf, len);
}

/* reg * x^(8n) mod P, given k = x^(8n-33) mod P: the 32x32 carry-less
 * product is reg * k * x (reflected, 64 bits) and crc32 of it from 0 is
 * that times x^32, mod P. */
TARGET_SSE42_PCLMUL static inline uint32_t shift(uint32_t reg, uint32_t k)
{
    __m128i prod = _mm_clmulepi64_si128(_mm_cvtsi32_si128((int)reg),
                                        _mm_cvtsi32_si128((int)k), 0x00);
    return (uint32_t)_mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(prod));
}

/* Three streams of n bytes each over p[0, 3n); returns the register. */
TARGET_SSE42_PCLMUL static inline uint32_t
three_way(uint32_t reg, const unsigned char *p, size_t n, uint32_t k)
{
    uint64_t r0 = reg, r1 = 0, r2 = 0;
    const unsigned char *end = p + n;

    do {
        r0 = _mm_crc32_u64(r0, load64(p));
        r1 = _mm_crc32_u64(r1, load64(p + n));
        r2 = _mm_crc32_u64(r2, load64(p + 2 * n));
        p += 8;
    } while (p < end);
    reg = shift((uint32_t)r0, k) ^ (uint32_t)r1;
    return shift(reg, k) ^ (uint32_t)r2;
}

TARGET_SSE42_PCLMUL uint32_t ss__crc32c_sse42_3way(uint32_t crc,
                                                   const void *buf, size_t len)
{
    const unsigned char *p = buf;
    uint32_t reg = ~crc;

    while (len >= 3 * SS__CRC32C_LONG) {
        reg = three_way(reg, p, SS__CRC32C_LONG, ss__crc32c_shift_long);
        p += 3 * SS__CRC32C_LONG;
        len -= 3 * SS__CRC32C_LONG;
    }
    while (len >= 3 * SS__CRC32C_SHORT) {
        reg = three_way(reg, p, SS__CRC32C_SHORT, ss__crc32c_shift_short);
        p += 3 * SS__CRC32C_SHORT;
        len -= 3 * SS__CRC32C_SHORT;
    }
    return ~crc32c_stream(reg, p, len);
}

#else
/* ISO C wants at least one declaration in a translation unit. */
typedef int ss__crc_x86_unused;
#endif /* SS__CRC_X86 */
