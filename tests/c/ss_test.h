/* ss_test.h - a minimal harness for the C-level core tests.
 * Each tests/c/test_<concern>.c is its own program:
 *
 *   static void test_something(void) { CHECK(x == 1); CHECK_EQ_INT(a, b); }
 *   int main(void) { RUN(test_something); return ss_test_report("crc"); }
 *
 * CHECK failures are counted and printed with file and line; a test
 * continues after a failed CHECK (each test counts once). */
#ifndef SS_TEST_H
#define SS_TEST_H

#include <dirent.h>
#include <stdint.h>
#include <stdio.h>

static int ss_t_passed, ss_t_failed, ss_t_cur_failed;

#define CHECK(cond)                                                            \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "  %s:%d: CHECK failed: %s\n", __FILE__, __LINE__, \
                    #cond);                                                    \
            ss_t_cur_failed = 1;                                               \
        }                                                                      \
    } while (0)

#define CHECK_EQ_INT(a, b)                                                     \
    do {                                                                       \
        long long a_ = (long long)(a), b_ = (long long)(b);                    \
        if (a_ != b_) {                                                        \
            fprintf(stderr,                                                    \
                    "  %s:%d: CHECK failed: %s == %s (%lld vs %lld)\n",        \
                    __FILE__, __LINE__, #a, #b, a_, b_);                       \
            ss_t_cur_failed = 1;                                               \
        }                                                                      \
    } while (0)

#define RUN(fn)                                                                \
    do {                                                                       \
        ss_t_cur_failed = 0;                                                   \
        fn();                                                                  \
        if (ss_t_cur_failed) {                                                 \
            ss_t_failed++;                                                     \
            fprintf(stderr, "FAIL %s\n", #fn);                                 \
        } else {                                                               \
            ss_t_passed++;                                                     \
        }                                                                      \
    } while (0)

/* A seeded xorshift64* generator for randomized cases: set ss_t_rng to
 * choose the sequence; rnd_in(lo, hi) is uniform enough in [lo, hi]. */
static uint64_t ss_t_rng = 0x9E3779B97F4A7C15ull;

static inline uint64_t rnd(void)
{
    ss_t_rng ^= ss_t_rng >> 12;
    ss_t_rng ^= ss_t_rng << 25;
    ss_t_rng ^= ss_t_rng >> 27;
    return ss_t_rng * 2685821657736338717ull;
}

static inline int64_t rnd_in(int64_t lo, int64_t hi)
{
    return lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1));
}

/* Open file descriptors of this process (entries of /proc/self/fd, the
 * listing's own included), or -1: tests compare it before and after. */
static inline int count_fds(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    if (d == NULL)
        return -1;
    while (readdir(d) != NULL)
        n++;
    closedir(d);
    return n;
}

/* Prints "<name>: N passed, N failed"; returns the exit status. */
static inline int ss_test_report(const char *name)
{
    printf("%s: %d passed, %d failed\n", name, ss_t_passed, ss_t_failed);
    return ss_t_failed ? 1 : 0;
}

#endif /* SS_TEST_H */
