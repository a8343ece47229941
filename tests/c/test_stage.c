/* test_stage.c - the staging pipeline (ss_stage) through ss_io on the host
 * backend (ss_devhost), whose stream is a thread: device writes and reads
 * give the same files, bytes and CRCs as plain ones for every buffer count
 * and thread count; copies run ahead of the writes but never past the
 * buffer pool; copy, pwrite and pread failures end the batch with the
 * error, without a hang, and leave the stage usable. Built with ASan +
 * UBSan + LSan by `make ctest`. */
#include "ss_crc.h"
#include "ss_devhost.h"
#include "ss_error.h"
#include "ss_io.h"
#include "ss_os.h"
#include "ss_pool.h"
#include "ss_stage.h"
#include "ss_test.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NFILES 2
#define NJOBS 10
#define BUF 4096

static char dir[64];
static char path_buf[NFILES][128];
static const char *paths[NFILES];
static unsigned char *src[NJOBS], *dst[NJOBS];
static uint64_t lens[NJOBS];
static int64_t offs[NJOBS];

static void setup(void)
{
    int64_t off[NFILES] = {0};
    for (int j = 0; j < NJOBS; j++) {
        lens[j] = j == 4 ? 0 : (uint64_t)rnd_in(1, 5 * BUF + 77);
        src[j] = malloc(lens[j] + 1);
        dst[j] = malloc(lens[j] + 1);
        for (uint64_t i = 0; i < lens[j]; i++)
            src[j][i] = (unsigned char)rnd();
        off[j % NFILES] += j * 13;
        offs[j] = off[j % NFILES];
        off[j % NFILES] += (int64_t)lens[j];
    }
}

static void wjobs_of(ss_io_wjob *w, int dev_mask)
{
    for (int j = 0; j < NJOBS; j++)
        w[j] = (ss_io_wjob){src[j], lens[j], (uint32_t)(j % NFILES), offs[j],
                            (dev_mask >> j) & 1};
}

static void rjobs_of(ss_io_rjob *r, int dev_mask, const uint32_t *crc)
{
    for (int j = 0; j < NJOBS; j++) {
        memset(dst[j], 0, lens[j] + 1);
        r[j] = (ss_io_rjob){
            dst[j],           lens[j],     (uint32_t)(j % NFILES), offs[j],
            crc ? crc[j] : 0, crc != NULL, (dev_mask >> j) & 1};
    }
}

static int all_equal(void)
{
    for (int j = 0; j < NJOBS; j++)
        if (memcmp(src[j], dst[j], lens[j]) != 0)
            return 0;
    return 1;
}

static ss_io_opts opts_for(ss_stage *st)
{
    ss_io_opts o = SS_IO_OPTS_INIT;
    o.piece = 3 * BUF; /* larger than a staging buffer: device pieces shrink */
    o.stage = st;
    return o;
}

/* Device write + device read == plain write + plain read, over buffer
 * counts and thread counts, with all jobs or half of them on the device. */
static void test_roundtrip(void)
{
    size_t nbufs[] = {1, 2, 5};
    int threads[] = {0, 1, 3};
    int masks[] = {(1 << NJOBS) - 1, 0x155};
    uint32_t plain[NJOBS], wcrc[NJOBS], rcrc[NJOBS];
    ss_io_wjob w[NJOBS];
    ss_io_rjob r[NJOBS];
    ss_errinfo e;
    ss_io_opts o0 = SS_IO_OPTS_INIT;

    wjobs_of(w, 0);
    CHECK_EQ_INT(
        ss_io_write(NULL, NULL, paths, NFILES, w, NJOBS, &o0, plain, &e), 0);
    for (size_t a = 0; a < 3; a++)
        for (size_t t = 0; t < 3; t++)
            for (size_t m = 0; m < 2; m++) {
                ss_devhost *h = NULL;
                ss_stage *st = NULL;
                ss_pool *pool = NULL;
                CHECK_EQ_INT(ss_devhost_new(&h), 0);
                ss_devhost_set_delay(h, 50);
                CHECK_EQ_INT(
                    ss_stage_new(&st, ss_devhost_dev(h), nbufs[a], BUF), 0);
                CHECK_EQ_INT(ss_pool_new(&pool, threads[t]), 0);
                ss_io_opts o = opts_for(st);
                wjobs_of(w, masks[m]);
                CHECK_EQ_INT(ss_io_write(NULL, pool, paths, NFILES, w, NJOBS,
                                         &o, wcrc, &e),
                             0);
                CHECK(memcmp(wcrc, plain, sizeof plain) == 0);
                long issued = ss_devhost_issued(h);
                CHECK(issued > 0);
                CHECK(ss_devhost_max_inflight(h) <= (long)nbufs[a]);
                rjobs_of(r, masks[m], plain);
                CHECK_EQ_INT(ss_io_read(NULL, pool, paths, NFILES, r, NJOBS, &o,
                                        rcrc, &e),
                             0);
                CHECK(all_equal());
                CHECK(memcmp(rcrc, plain, sizeof plain) == 0);
                CHECK_EQ_INT(ss_devhost_completed(h), ss_devhost_issued(h));
                ss_pool_free(pool);
                ss_stage_free(st);
                ss_devhost_free(h);
            }
}

/* With slow copies and several buffers, copies are queued ahead of the
 * writes (more than one in flight), and every piece is copied once. */
static void test_copy_ahead(void)
{
    ss_devhost *h = NULL;
    ss_stage *st = NULL;
    ss_io_wjob w[NJOBS];
    ss_errinfo e;
    size_t pieces = 0;
    CHECK_EQ_INT(ss_devhost_new(&h), 0);
    ss_devhost_set_delay(h, 2000);
    CHECK_EQ_INT(ss_stage_new(&st, ss_devhost_dev(h), 4, BUF), 0);
    ss_io_opts o = opts_for(st);
    wjobs_of(w, (1 << NJOBS) - 1);
    for (int j = 0; j < NJOBS; j++)
        pieces += (lens[j] + BUF - 1) / BUF;
    CHECK_EQ_INT(ss_io_write(NULL, NULL, paths, NFILES, w, NJOBS, &o, NULL, &e),
                 0);
    CHECK_EQ_INT(ss_devhost_issued(h), (long)pieces);
    CHECK(ss_devhost_max_inflight(h) >= 2);
    CHECK(ss_devhost_max_inflight(h) <= 4);
    ss_stage_free(st);
    ss_devhost_free(h);
}

/* A failing copy (write or read side), pwrite or pread ends the batch with
 * its error; the next batch on the same stage succeeds. */
static void test_failures(void)
{
    ss_devhost *h = NULL;
    ss_stage *st = NULL;
    ss_pool *pool = NULL;
    ss_faults *f = NULL;
    ss_io_wjob w[NJOBS];
    ss_io_rjob r[NJOBS];
    uint32_t crc[NJOBS];
    ss_errinfo e;
    CHECK_EQ_INT(ss_devhost_new(&h), 0);
    CHECK_EQ_INT(ss_stage_new(&st, ss_devhost_dev(h), 2, BUF), 0);
    CHECK_EQ_INT(ss_pool_new(&pool, 3), 0);
    CHECK_EQ_INT(ss_faults_new(&f, NULL), 0);
    ss_io_opts o = opts_for(st);
    wjobs_of(w, (1 << NJOBS) - 1);
    CHECK_EQ_INT(ss_io_write(NULL, pool, paths, NFILES, w, NJOBS, &o, crc, &e),
                 0);

    for (long k = 1; k <= 7; k += 3) {
        ss_devhost_fail_copy(h, k, -EIO);
        CHECK_EQ_INT(
            ss_io_write(NULL, pool, paths, NFILES, w, NJOBS, &o, NULL, &e),
            -EIO);
        CHECK(strcmp(e.op, "device copy") == 0);
        ss_devhost_fail_copy(h, k, -EIO);
        rjobs_of(r, (1 << NJOBS) - 1, crc);
        CHECK_EQ_INT(
            ss_io_read(NULL, pool, paths, NFILES, r, NJOBS, &o, NULL, &e),
            -EIO);
        ss_devhost_fail_copy(h, 0, 0);
    }
    ss_faults_fail(f, SS_OS_PWRITE, 3, ENOSPC);
    CHECK_EQ_INT(ss_io_write(ss_faults_os(f), pool, paths, NFILES, w, NJOBS, &o,
                             NULL, &e),
                 -ENOSPC);
    ss_faults_reset(f);
    CHECK_EQ_INT(ss_io_write(NULL, pool, paths, NFILES, w, NJOBS, &o, NULL, &e),
                 0);
    ss_faults_fail(f, SS_OS_PREAD, 2, EIO);
    rjobs_of(r, (1 << NJOBS) - 1, crc);
    CHECK_EQ_INT(ss_io_read(ss_faults_os(f), pool, paths, NFILES, r, NJOBS, &o,
                            NULL, &e),
                 -EIO);
    ss_faults_reset(f);
    /* a wrong expected CRC on a device job */
    uint32_t bad[NJOBS];
    memcpy(bad, crc, sizeof bad);
    bad[1] ^= 1;
    rjobs_of(r, (1 << NJOBS) - 1, bad);
    CHECK_EQ_INT(ss_io_read(NULL, pool, paths, NFILES, r, NJOBS, &o, NULL, &e),
                 SS_ECHECKSUM);
    CHECK_EQ_INT(e.job, 1);
    /* and the stage still works */
    rjobs_of(r, (1 << NJOBS) - 1, crc);
    CHECK_EQ_INT(ss_io_read(NULL, pool, paths, NFILES, r, NJOBS, &o, NULL, &e),
                 0);
    CHECK(all_equal());
    CHECK_EQ_INT(ss_devhost_completed(h), ss_devhost_issued(h));
    ss_faults_free(f);
    ss_pool_free(pool);
    ss_stage_free(st);
    ss_devhost_free(h);
}

static void test_validation(void)
{
    ss_devhost *h = NULL;
    ss_stage *st = NULL;
    ss_io_wjob w[NJOBS];
    ss_errinfo e;
    ss_io_opts o = SS_IO_OPTS_INIT;
    CHECK_EQ_INT(ss_devhost_new(&h), 0);
    /* a device job without a stage */
    wjobs_of(w, 1 << 2);
    CHECK_EQ_INT(ss_io_write(NULL, NULL, paths, NFILES, w, NJOBS, &o, NULL, &e),
                 SS_EINVAL);
    CHECK(strstr(e.detail, "staging") != NULL);
    /* bad stage shapes */
    CHECK_EQ_INT(ss_stage_new(&st, ss_devhost_dev(h), 0, BUF), SS_EINVAL);
    CHECK_EQ_INT(ss_stage_new(&st, ss_devhost_dev(h), 2, 100), SS_EINVAL);
    CHECK_EQ_INT(ss_stage_new(&st, NULL, 2, BUF), SS_EINVAL);
    /* an item larger than a buffer */
    CHECK_EQ_INT(ss_stage_new(&st, ss_devhost_dev(h), 2, BUF), 0);
    ss_stage_item big = {src[0], BUF + 1};
    CHECK_EQ_INT(ss__stage_begin_d2h(st, &big, 1, NULL), SS_EINVAL);
    CHECK_EQ_INT(ss__stage_begin_h2d(st), 0); /* and no batch was left open */
    CHECK_EQ_INT(ss__stage_end(st), 0);
    ss_stage_free(st);
    ss_stage_free(NULL);
    ss_devhost_free(h);
}

/* Batches from several threads on one stage take turns; each is right. */
typedef struct {
    ss_stage *st;
    int id, ok;
} conc_arg;

static void *conc_main(void *v)
{
    conc_arg *a = v;
    ss_io_wjob w[NJOBS];
    ss_io_rjob r[NJOBS];
    uint32_t crc[NJOBS], back[NJOBS];
    unsigned char *buf[NJOBS];
    char pb[NFILES][160];
    const char *ps[NFILES];
    ss_errinfo e;
    ss_io_opts o = opts_for(a->st);
    a->ok = 1;
    for (int i = 0; i < NFILES; i++) {
        snprintf(pb[i], sizeof pb[i], "%s/t%d_%d", dir, a->id, i);
        ps[i] = pb[i];
    }
    for (int round = 0; round < 4; round++) {
        wjobs_of(w, (1 << NJOBS) - 1);
        a->ok &=
            ss_io_write(NULL, NULL, ps, NFILES, w, NJOBS, &o, crc, &e) == 0;
        for (int j = 0; j < NJOBS; j++) {
            buf[j] = malloc(lens[j] + 1);
            r[j] = (ss_io_rjob){
                buf[j], lens[j], (uint32_t)(j % NFILES), offs[j], crc[j], 1, 1};
        }
        a->ok &=
            ss_io_read(NULL, NULL, ps, NFILES, r, NJOBS, &o, back, &e) == 0;
        for (int j = 0; j < NJOBS; j++) {
            a->ok &= memcmp(buf[j], src[j], lens[j]) == 0;
            free(buf[j]);
        }
    }
    for (int i = 0; i < NFILES; i++)
        unlink(ps[i]);
    return NULL;
}

static void test_concurrent_batches(void)
{
    ss_devhost *h = NULL;
    ss_stage *st = NULL;
    pthread_t t[3];
    conc_arg args[3];
    CHECK_EQ_INT(ss_devhost_new(&h), 0);
    ss_devhost_set_delay(h, 20);
    CHECK_EQ_INT(ss_stage_new(&st, ss_devhost_dev(h), 2, BUF), 0);
    for (int i = 0; i < 3; i++) {
        args[i] = (conc_arg){st, i, 0};
        pthread_create(&t[i], NULL, conc_main, &args[i]);
    }
    for (int i = 0; i < 3; i++) {
        pthread_join(t[i], NULL);
        CHECK(args[i].ok);
    }
    ss_stage_free(st);
    ss_devhost_free(h);
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/ss_test_stage.XXXXXX");
    if (mkdtemp(dir) == NULL)
        return 2;
    for (int i = 0; i < NFILES; i++) {
        snprintf(path_buf[i], sizeof path_buf[i], "%s/f%d", dir, i);
        paths[i] = path_buf[i];
    }
    setup();
    RUN(test_roundtrip);
    RUN(test_copy_ahead);
    RUN(test_failures);
    RUN(test_validation);
    RUN(test_concurrent_batches);
    for (int i = 0; i < NFILES; i++)
        unlink(paths[i]);
    rmdir(dir);
    for (int j = 0; j < NJOBS; j++) {
        free(src[j]);
        free(dst[j]);
    }
    return ss_test_report("stage");
}
