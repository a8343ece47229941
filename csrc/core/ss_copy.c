/* ss_copy.c - see ss_copy.h. */
#include "ss_copy.h"

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h> /* SSE2: part of the x86-64 baseline, no dispatch */

#define LINE 64
#define PAGE 4096
#define WAYS 4 /* pages read in an interleaved walk */

/* One 64-byte line: unaligned loads, aligned streaming stores. */
static inline void line(char *d, const char *s)
{
    __m128i a = _mm_loadu_si128((const __m128i *)(const void *)s);
    __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(s + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(s + 32));
    __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(s + 48));
    _mm_stream_si128((__m128i *)(void *)d, a);
    _mm_stream_si128((__m128i *)(void *)(d + 16), b);
    _mm_stream_si128((__m128i *)(void *)(d + 32), c);
    _mm_stream_si128((__m128i *)(void *)(d + 48), e);
}

static void stream_copy(char *d, const char *s, size_t n)
{
    /* Align the destination to a line; the head goes through the cache. */
    size_t head = (LINE - ((uintptr_t)d & (LINE - 1))) & (LINE - 1);
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= WAYS * PAGE;
         d += WAYS * PAGE, s += WAYS * PAGE, n -= WAYS * PAGE)
        for (size_t l = 0; l < PAGE; l += LINE)
            for (size_t w = 0; w < WAYS; w++)
                line(d + w * PAGE + l, s + w * PAGE + l);
    for (; n >= LINE; d += LINE, s += LINE, n -= LINE)
        line(d, s);
    _mm_sfence(); /* order the streamed lines before anything after us */
    memcpy(d, s, n);
}

void ss_copy(void *dst, const void *src, size_t n)
{
    if (n < SS_COPY_STREAM_MIN) {
        memcpy(dst, src, n);
        return;
    }
    stream_copy(dst, src, n);
}

#else

void ss_copy(void *dst, const void *src, size_t n)
{
    memcpy(dst, src, n);
}

#endif
