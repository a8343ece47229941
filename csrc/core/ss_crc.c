/* ss_crc.c - CRC-32 and CRC-32C. Portable table implementation
 * (placeholder for the accelerated one). Thread safety: reentrant; the
 * tables are built once under pthread_once. */
#include "ss_crc.h"

#include <pthread.h>

static uint32_t tab32[256], tab32c[256];
static pthread_once_t tab_once = PTHREAD_ONCE_INIT;

static void build_tables(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t a = i, b = i;
        for (int k = 0; k < 8; k++) {
            a = (a >> 1) ^ (0xEDB88320u & (0u - (a & 1u)));
            b = (b >> 1) ^ (0x82F63B78u & (0u - (b & 1u)));
        }
        tab32[i] = a;
        tab32c[i] = b;
    }
}

static uint32_t crc_bytes(const uint32_t *tab, uint32_t crc, const void *buf,
                          size_t len)
{
    const unsigned char *p = buf;
    crc = ~crc;
    while (len--)
        crc = (crc >> 8) ^ tab[(crc ^ *p++) & 0xFFu];
    return ~crc;
}

uint32_t ss_crc32(uint32_t crc, const void *buf, size_t len)
{
    pthread_once(&tab_once, build_tables);
    return crc_bytes(tab32, crc, buf, len);
}

uint32_t ss_crc32c(uint32_t crc, const void *buf, size_t len)
{
    pthread_once(&tab_once, build_tables);
    return crc_bytes(tab32c, crc, buf, len);
}

/* GF(2) multiply of a and b modulo the reflected polynomial. */
static uint32_t gf2_mul(uint32_t a, uint32_t b, uint32_t poly)
{
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0)
                break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ poly : b >> 1;
    }
    return p;
}

/* x^(8*n) mod poly, by square-and-multiply. */
static uint32_t x8n(uint64_t n, uint32_t poly)
{
    uint32_t result = 1u << 31; /* x^0 */
    uint32_t sq = 1u << 23;     /* x^8 */
    while (n) {
        if (n & 1)
            result = gf2_mul(sq, result, poly);
        n >>= 1;
        sq = gf2_mul(sq, sq, poly);
    }
    return result;
}

uint32_t ss_crc32_combine(uint32_t crc1, uint32_t crc2, uint64_t len2)
{
    return gf2_mul(x8n(len2, 0xEDB88320u), crc1, 0xEDB88320u) ^ crc2;
}

uint32_t ss_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2)
{
    return gf2_mul(x8n(len2, 0x82F63B78u), crc1, 0x82F63B78u) ^ crc2;
}

const char *ss_crc32_impl(void) { return "portable"; }
const char *ss_crc32c_impl(void) { return "portable"; }
