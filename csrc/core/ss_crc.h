/* ss_crc.h - CRC-32 (zlib/zip polynomial 0xEDB88320, reflected) and
 * CRC-32C (Castagnoli, 0x82F63B78, reflected).
 *
 * Both take and return the finished (post-inverted) value, like zlib's
 * crc32(): start with 0, feed the result back in to continue. buf may be
 * NULL when len is 0.
 * combine(crc(A), crc(B), len(B)) == crc(A || B), so pieces checksummed in
 * parallel give the value of the whole record.
 *
 * The fastest implementation the CPU supports is chosen once, at first use.
 * Thread safety: all functions are reentrant; ss_crc_force_portable() is
 * atomic and may be called at any time (it changes speed, never values).
 */
#ifndef SS_CRC_H
#define SS_CRC_H

#include <stddef.h>
#include <stdint.h>

uint32_t ss_crc32(uint32_t crc, const void *buf, size_t len);
uint32_t ss_crc32c(uint32_t crc, const void *buf, size_t len);

uint32_t ss_crc32_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);
uint32_t ss_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);

/* Name of the implementation in use for each: "vpclmul", "pclmul" or
 * "portable" for CRC-32; "vpclmul+sse42", "sse42-3way", "sse42" or
 * "portable" for CRC-32C. */
const char *ss_crc32_impl(void);
const char *ss_crc32c_impl(void);

/* For tests: on != 0 makes both checksums use the portable code, 0 goes
 * back to the fastest. Returns the previous setting (0 or 1). */
int ss_crc_force_portable(int on);

#endif /* SS_CRC_H */
