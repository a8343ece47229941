/* test_devcuda.c - the CUDA staging backend (ss_devcuda) through ss_stage
 * and ss_io, on the stand-in libcudart the Makefile builds (its "device"
 * memory is host memory and its copies are memmove): device writes and
 * reads equal plain ones, d2h copies are issued as DEVICE_TO_HOST and h2d
 * ones as HOST_TO_DEVICE, each batch orders its stream after the caller's
 * once, and a failing cudaMemcpyAsync ends the batch with SS_EDEVICE and
 * the runtime's message, leaving the stage usable. No GPU is needed. */
#include "ss_cuda.h"
#include "ss_devcuda.h"
#include "ss_error.h"
#include "ss_io.h"
#include "ss_pool.h"
#include "ss_stage.h"
#include "ss_test.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef SS_TEST_FAKE_DIR
#error "build with -DSS_TEST_FAKE_DIR=\"...\" (see the Makefile)"
#endif

#define N 6
#define BUF 4096

static char dir[64], path[128];
static const char *paths[1];
static unsigned char *src[N], *dst[N];
static uint64_t lens[N];
static int64_t offs[N];
static const ss_cuda *cu;
static void (*fail_copy_at)(long, int);
static long (*copies)(int);
static long (*waits)(void);

static void setup(void)
{
    char lib[SS_DL_PATH_MAX], why[SS_DL_REASON_MAX];
    snprintf(lib, sizeof lib, "%s/libfake_cudart_ok.so", SS_TEST_FAKE_DIR);
    const char *c[] = {lib};
    if (ss_cuda_load(c, 1, &cu, why, sizeof why) != 0) {
        fprintf(stderr, "cannot load %s: %s\n", lib, why);
        exit(2);
    }
    fail_copy_at =
        (void (*)(long, int))dlsym(cu->lib.handle, "fake_cuda_fail_copy_at");
    copies = (long (*)(int))dlsym(cu->lib.handle, "fake_cuda_copies");
    waits = (long (*)(void))dlsym(cu->lib.handle, "fake_cuda_waits");
    if (!fail_copy_at || !copies || !waits)
        exit(2);
    int64_t off = 0;
    for (int j = 0; j < N; j++) {
        lens[j] = (uint64_t)rnd_in(0, 3 * BUF + 100);
        src[j] = malloc(lens[j] + 1);
        dst[j] = malloc(lens[j] + 1);
        for (uint64_t i = 0; i < lens[j]; i++)
            src[j][i] = (unsigned char)rnd();
        offs[j] = off;
        off += (int64_t)lens[j] + 7;
    }
}

static uint64_t pieces(void)
{
    uint64_t n = 0;
    for (int j = 0; j < N; j++)
        n += (lens[j] + BUF - 1) / BUF;
    return n;
}

static void test_roundtrip_and_kinds(void)
{
    ss_devcuda *d = NULL;
    ss_stage *st = NULL;
    ss_pool *pool = NULL;
    ss_io_wjob w[N];
    ss_io_rjob r[N];
    uint32_t wcrc[N], rcrc[N], plain[N];
    ss_errinfo e;
    ss_io_opts o = SS_IO_OPTS_INIT;
    CHECK_EQ_INT(ss_devcuda_new(&d, NULL, 0, NULL), SS_EINVAL);
    CHECK_EQ_INT(ss_devcuda_new(&d, cu, 1, NULL), 0);
    CHECK(strcmp(ss_devcuda_dev(d)->name, "cuda") == 0);
    CHECK_EQ_INT(ss_stage_new(&st, ss_devcuda_dev(d), 2, BUF), 0);
    CHECK_EQ_INT(ss_pool_new(&pool, 2), 0);
    for (int j = 0; j < N; j++)
        w[j] = (ss_io_wjob){src[j], lens[j], 0, offs[j], 0};
    CHECK_EQ_INT(ss_io_write(NULL, pool, paths, 1, w, N, &o, plain, &e), 0);
    o.stage = st;
    for (int j = 0; j < N; j++)
        w[j].dev = 1;
    long d2h = copies(2), h2d = copies(1), wt = waits();
    CHECK_EQ_INT(ss_io_write(NULL, pool, paths, 1, w, N, &o, wcrc, &e), 0);
    CHECK(memcmp(wcrc, plain, sizeof plain) == 0);
    CHECK_EQ_INT(copies(2) - d2h, (long)pieces());
    CHECK_EQ_INT(copies(1) - h2d, 0);
    CHECK_EQ_INT(waits() - wt, 1); /* ordered after the caller's stream once */
    for (int j = 0; j < N; j++) {
        memset(dst[j], 0, lens[j] + 1);
        r[j] = (ss_io_rjob){dst[j], lens[j], 0, offs[j], plain[j], 1, 1};
    }
    CHECK_EQ_INT(ss_io_read(NULL, pool, paths, 1, r, N, &o, rcrc, &e), 0);
    CHECK_EQ_INT(copies(1) - h2d, (long)pieces());
    for (int j = 0; j < N; j++)
        CHECK(memcmp(src[j], dst[j], lens[j]) == 0);
    ss_pool_free(pool);
    ss_stage_free(st);
    ss_devcuda_free(d);
}

static void test_copy_failure(void)
{
    ss_devcuda *d = NULL;
    ss_stage *st = NULL;
    ss_io_wjob w[N];
    ss_io_rjob r[N];
    uint32_t crc[N];
    ss_errinfo e;
    ss_io_opts o = SS_IO_OPTS_INIT;
    CHECK_EQ_INT(ss_devcuda_new(&d, cu, 0, NULL), 0);
    CHECK_EQ_INT(ss_stage_new(&st, ss_devcuda_dev(d), 2, BUF), 0);
    o.stage = st;
    for (int j = 0; j < N; j++)
        w[j] = (ss_io_wjob){src[j], lens[j], 0, offs[j], 1};
    fail_copy_at(3, 700);
    CHECK_EQ_INT(ss_io_write(NULL, NULL, paths, 1, w, N, &o, NULL, &e),
                 SS_EDEVICE);
    CHECK(strstr(e.detail, "cudaMemcpyAsync: an illegal memory access") !=
          NULL);
    CHECK_EQ_INT(ss_io_write(NULL, NULL, paths, 1, w, N, &o, crc, &e), 0);
    for (int j = 0; j < N; j++)
        r[j] = (ss_io_rjob){dst[j], lens[j], 0, offs[j], crc[j], 1, 1};
    fail_copy_at(2, 700);
    CHECK_EQ_INT(ss_io_read(NULL, NULL, paths, 1, r, N, &o, NULL, &e),
                 SS_EDEVICE);
    CHECK(strstr(e.detail, "(CUDA error 700)") != NULL);
    CHECK_EQ_INT(ss_io_read(NULL, NULL, paths, 1, r, N, &o, NULL, &e), 0);
    for (int j = 0; j < N; j++)
        CHECK(memcmp(src[j], dst[j], lens[j]) == 0);
    ss_stage_free(st);
    ss_devcuda_free(d);
}

static void test_bad_device(void)
{
    ss_devcuda *d = NULL;
    /* the fake has 2 devices: ordinal 5 fails in cudaSetDevice */
    ss_errinfo e;
    ss_errinfo_clear(&e);
    CHECK_EQ_INT(ss_devcuda_new(&d, cu, 5, &e), SS_EDEVICE);
    CHECK(d == NULL);
    CHECK(strstr(e.detail, "cudaSetDevice: invalid device ordinal") != NULL);
    CHECK_EQ_INT(ss_devcuda_new(&d, cu, -1, NULL), SS_EINVAL);
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/ss_test_devcuda.XXXXXX");
    if (mkdtemp(dir) == NULL)
        return 2;
    snprintf(path, sizeof path, "%s/f", dir);
    paths[0] = path;
    setup();
    RUN(test_roundtrip_and_kinds);
    RUN(test_copy_failure);
    RUN(test_bad_device);
    unlink(path);
    rmdir(dir);
    for (int j = 0; j < N; j++) {
        free(src[j]);
        free(dst[j]);
    }
    return ss_test_report("devcuda");
}
