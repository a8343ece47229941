/* test_copy.c - ss_copy equals memcpy for every size around the streaming
 * threshold and the 4-page walk, at every destination/source misalignment
 * within a line, and touches no byte outside [dst, dst + n). */
#include "ss_copy.h"
#include "ss_test.h"

#include <stdlib.h>
#include <string.h>

#define GUARD 256

static void check_copy(size_t n, size_t doff, size_t soff)
{
    unsigned char *src = malloc(n + soff + 64);
    unsigned char *dst = malloc(n + doff + 2 * GUARD + 64);
    for (size_t i = 0; i < n + soff + 64; i++)
        src[i] = (unsigned char)rnd();
    memset(dst, 0xA5, n + doff + 2 * GUARD + 64);
    unsigned char *d = dst + GUARD + doff;
    ss_copy(d, src + soff, n);
    CHECK(memcmp(d, src + soff, n) == 0);
    int guard_ok = 1;
    for (size_t i = 0; i < GUARD + doff; i++)
        guard_ok &= dst[i] == 0xA5;
    for (size_t i = 0; i < GUARD; i++)
        guard_ok &= d[n + i] == 0xA5;
    CHECK(guard_ok);
    free(src);
    free(dst);
}

static void test_small_sizes(void)
{
    size_t sizes[] = {0, 1, 63, 64, 65, 4095, 4096, 16383, 16384, 16385};
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++)
        check_copy(sizes[k], 3, 5);
}

static void test_streaming_sizes(void)
{
    /* Around the threshold, whole and partial 4-page walks, odd tails. */
    size_t base[] = {
        SS_COPY_STREAM_MIN - 1, SS_COPY_STREAM_MIN,
        SS_COPY_STREAM_MIN + 1, SS_COPY_STREAM_MIN + 16384 + 4096 + 63,
        (size_t)3 << 20,        ((size_t)5 << 20) + 12345};
    for (size_t k = 0; k < sizeof base / sizeof *base; k++)
        for (size_t doff = 0; doff < 64; doff += 7)
            check_copy(base[k], doff, (doff * 5) % 64);
}

static void test_random(void)
{
    for (int i = 0; i < 40; i++)
        check_copy((size_t)rnd_in(SS_COPY_STREAM_MIN - 100, (int64_t)2 << 20),
                   (size_t)rnd_in(0, 63), (size_t)rnd_in(0, 63));
}

int main(void)
{
    RUN(test_small_sizes);
    RUN(test_streaming_sizes);
    RUN(test_random);
    return ss_test_report("copy");
}
