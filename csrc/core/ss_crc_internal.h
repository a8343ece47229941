/* ss_crc_internal.h - what ss_crc.c (portable code, dispatch) and
 * ss_crc_x86.c (accelerated code) share. Not part of the public API; the
 * C tests include it to check every implementation and the constants.
 *
 * Conventions: every checksum function here takes and returns the finished
 * (post-inverted) value, exactly like ss_crc32(), so implementations are
 * interchangeable and can hand short tails to the portable code.
 * Polynomials are given in reflected form (0xEDB88320, 0x82F63B78).
 *
 * Thread safety: ss__crc_fold_init() writes the struct it is given and
 * nothing else; everything else is reentrant.
 */
#ifndef SS_CRC_INTERNAL_H
#define SS_CRC_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#define SS__CRC32_POLY 0xEDB88320u
#define SS__CRC32C_POLY 0x82F63B78u

/* Block sizes of the 3-stream CRC-32C code (bytes per stream). */
#define SS__CRC32C_LONG 8192
#define SS__CRC32C_SHORT 256

/* Carry-less multiply folding constants for one polynomial. Each fold
 * pair is {x^(D+32) mod P, x^(D-32) mod P}, bit-reflected and shifted left
 * by one (the form the PCLMULQDQ folding step needs) for a fold distance of
 * D bits: the low 64 bits of a 128-bit lane are multiplied by the first,
 * the high 64 bits by the second. */
typedef struct ss__crc_fold {
    uint64_t fold2048[2]; /* D = 2048: four 512-bit lanes (VPCLMULQDQ) */
    uint64_t fold512[2];  /* D = 512: four 128-bit lanes, or one 512-bit */
    uint64_t fold128[2];  /* D = 128: one 128-bit lane */
    uint64_t k64[2];      /* {x^64 mod P, 0}: 96 bits -> 64 bits */
    uint64_t poly_mu[2];  /* {P', mu'}: Barrett reduction 64 -> 32 bits */
} ss__crc_fold;

/* x^n mod P, bit-reflected (bit 31 is x^0), for the reflected poly. */
uint32_t ss__crc_xpow(uint32_t poly, uint64_t n);

/* Fill k with the folding constants of the reflected poly. */
void ss__crc_fold_init(ss__crc_fold *k, uint32_t poly);

/* The portable (slicing-by-16) implementations. */
uint32_t ss__crc32_portable(uint32_t crc, const void *buf, size_t len);
uint32_t ss__crc32c_portable(uint32_t crc, const void *buf, size_t len);

/* SS_CRC_NO_X86 builds the portable-only variant on x86 too, to check that
 * what other architectures compile builds and passes. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(SS_CRC_NO_X86)
#define SS__CRC_X86 1
/* Need PCLMULQDQ + SSE4.1. k: constants of the polynomial that portable
 * computes; portable handles the tails. */
uint32_t ss__crc_pclmul(uint32_t crc, const void *buf, size_t len,
                        const ss__crc_fold *k,
                        uint32_t (*portable)(uint32_t, const void *, size_t));
/* Need AVX512F + VPCLMULQDQ + PCLMULQDQ + SSE4.1. Below
 * SS__CRC_VPCLMUL_MIN bytes it hands the buffer to ss__crc_pclmul. */
#define SS__CRC_VPCLMUL_MIN 1024
uint32_t ss__crc_vpclmul(uint32_t crc, const void *buf, size_t len,
                         const ss__crc_fold *k,
                         uint32_t (*portable)(uint32_t, const void *, size_t));
/* CRC-32C with the SSE4.2 crc32 instruction, one stream. */
uint32_t ss__crc32c_sse42(uint32_t crc, const void *buf, size_t len);
/* CRC-32C with three interleaved crc32 streams, recombined with a
 * PCLMULQDQ shift. Need SSE4.2 + PCLMULQDQ. */
uint32_t ss__crc32c_sse42_3way(uint32_t crc, const void *buf, size_t len);
/* The shift constants of the 3-stream code: x^(8n - 33) mod P, reflected,
 * for n = SS__CRC32C_LONG and SS__CRC32C_SHORT. */
extern const uint32_t ss__crc32c_shift_long, ss__crc32c_shift_short;
#endif

#endif /* SS_CRC_INTERNAL_H */
