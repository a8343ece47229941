/* test_io.c - batch write/read round trips, the fault-injection matrix,
 * atomic publish and the raw baselines, at the C level. Built with
 * ASan+UBSan+LSan by `make ctest`, so every injected fault also proves that
 * nothing leaks; descriptors are counted in /proc/self/fd. */
#include "ss_crc.h"
#include "ss_error.h"
#include "ss_file.h"
#include "ss_io.h"
#include "ss_os.h"
#include "ss_pool.h"
#include "ss_test.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define NFILES 3
#define NJOBS 24
#define PIECE 4096

static char dir[64];
static char path_buf[NFILES][128];
static const char *paths[NFILES];
static unsigned char *src[NJOBS], *dst[NJOBS];
static ss_io_wjob wjobs[NJOBS];
static ss_io_rjob rjobs[NJOBS];
static ss_pool *pool;

/* Files in dir (without . and ..). */
static int count_entries(const char *d_path)
{
    int n = 0;
    struct dirent *e;
    DIR *d = opendir(d_path);
    if (d == NULL)
        return -1;
    while ((e = readdir(d)) != NULL)
        n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
    closedir(d);
    return n;
}

/* Jobs of varied sizes (some 0, some many pieces), round-robin over the
 * files with gaps between them. */
static void setup_jobs(void)
{
    int64_t off[NFILES] = {0};
    unsigned seed = 12345;
    for (int j = 0; j < NJOBS; j++) {
        uint64_t len = j % 7 == 3 ? 0 : (uint64_t)(j * 3001 + j * j * 977);
        int f = j % NFILES;
        free(src[j]);
        free(dst[j]);
        src[j] = malloc(len + 1);
        dst[j] = malloc(len + 1);
        for (uint64_t i = 0; i < len; i++) {
            seed = seed * 1103515245u + 12345u;
            src[j][i] = (unsigned char)(seed >> 16);
        }
        off[f] += j * 11; /* a gap */
        wjobs[j] = (ss_io_wjob){src[j], len, (uint32_t)f, off[f]};
        rjobs[j] = (ss_io_rjob){dst[j], len, (uint32_t)f, off[f], 0, 0};
        off[f] += (int64_t)len;
    }
}

static ss_io_opts opts_piece(void)
{
    ss_io_opts o = SS_IO_OPTS_INIT;
    o.piece = PIECE;
    return o;
}

/* Write then read everything through os; data and CRCs must match. */
static void roundtrip(const ss_os *os, int fsync_on)
{
    uint32_t wcrc[NJOBS], rcrc[NJOBS];
    ss_io_opts o = opts_piece();
    ss_errinfo e;
    o.fsync = fsync_on;
    o.writeback = fsync_on;
    CHECK_EQ_INT(
        ss_io_write(os, pool, paths, NFILES, wjobs, NJOBS, &o, wcrc, &e), 0);
    for (int j = 0; j < NJOBS; j++) {
        CHECK_EQ_INT(wcrc[j], ss_crc32(0, src[j], wjobs[j].len));
        rjobs[j].crc = wcrc[j];
        rjobs[j].has_crc = 1;
        memset(dst[j], 0xEE, wjobs[j].len);
    }
    CHECK_EQ_INT(
        ss_io_read(os, pool, paths, NFILES, rjobs, NJOBS, &o, rcrc, &e), 0);
    for (int j = 0; j < NJOBS; j++) {
        CHECK_EQ_INT(rcrc[j], wcrc[j]);
        CHECK(memcmp(src[j], dst[j], wjobs[j].len) == 0);
    }
}

static void test_roundtrip(void)
{
    roundtrip(NULL, 0);
    roundtrip(NULL, 1);
    /* serial too */
    ss_pool *keep = pool;
    pool = NULL;
    roundtrip(NULL, 0);
    pool = keep;
}

static void test_checksum_off_and_gaps(void)
{
    uint32_t crc[NJOBS];
    ss_io_opts o = opts_piece();
    unsigned char zero = 1;
    o.checksum = 0;
    CHECK_EQ_INT(
        ss_io_write(NULL, pool, paths, NFILES, wjobs, NJOBS, &o, crc, NULL), 0);
    for (int j = 0; j < NJOBS; j++)
        CHECK_EQ_INT(crc[j], 0);
    /* the byte before job 1 is in a gap: it reads as zero */
    int fd = open(paths[1], O_RDONLY);
    CHECK_EQ_INT(pread(fd, &zero, 1, wjobs[1].offset - 1), 1);
    CHECK_EQ_INT(zero, 0);
    close(fd);
}

static void test_checksum_mismatch(void)
{
    ss_errinfo e;
    int j = 5;
    roundtrip(NULL, 0);
    /* flip one byte of job j on disk */
    int fd = open(paths[rjobs[j].file], O_RDWR);
    unsigned char c = src[j][7] ^ 0x40;
    CHECK_EQ_INT(pwrite(fd, &c, 1, rjobs[j].offset + 7), 1);
    close(fd);
    ss_io_opts o = opts_piece();
    CHECK_EQ_INT(
        ss_io_read(NULL, pool, paths, NFILES, rjobs, NJOBS, &o, NULL, &e),
        SS_ECHECKSUM);
    CHECK_EQ_INT(e.job, j);
    CHECK_EQ_INT(e.offset, rjobs[j].offset);
    CHECK(strcmp(e.path, paths[rjobs[j].file]) == 0);
    o.verify = 0;
    CHECK_EQ_INT(
        ss_io_read(NULL, pool, paths, NFILES, rjobs, NJOBS, &o, NULL, &e), 0);
    for (int k = 0; k < NJOBS; k++)
        rjobs[k].has_crc = 0;
}

static void test_range_and_validation(void)
{
    ss_errinfo e;
    ss_io_opts o = opts_piece();
    roundtrip(NULL, 0);
    ss_io_rjob bad = rjobs[NJOBS - 1];
    bad.offset += 1; /* one byte past the end */
    bad.has_crc = 0;
    CHECK_EQ_INT(ss_io_read(NULL, pool, paths, NFILES, &bad, 1, &o, NULL, &e),
                 SS_ERANGE);
    CHECK_EQ_INT(e.offset, bad.offset);
    CHECK_EQ_INT(e.job, 0);
    CHECK(strstr(e.path, "f") != NULL);
    bad.file = NFILES;
    CHECK_EQ_INT(ss_io_read(NULL, pool, paths, NFILES, &bad, 1, &o, NULL, &e),
                 SS_EINVAL);
    ss_io_wjob wbad = wjobs[1];
    wbad.offset = -1;
    CHECK_EQ_INT(ss_io_write(NULL, pool, paths, NFILES, &wbad, 1, &o, NULL, &e),
                 SS_EINVAL);
    ss_io_opts small = opts_piece();
    small.size = 8;
    CHECK_EQ_INT(
        ss_io_write(NULL, pool, paths, NFILES, wjobs, NJOBS, &small, NULL, &e),
        SS_EINVAL);
    CHECK(strstr(e.detail, "size") != NULL);
    const char *missing[] = {"/nonexistent-dir-ss/x"};
    CHECK_EQ_INT(ss_io_read(NULL, pool, missing, 1, NULL, 0, &o, NULL, &e),
                 -ENOENT);
    CHECK_EQ_INT(e.sys_errno, ENOENT);
    CHECK(strcmp(e.path, missing[0]) == 0);
}

/* Calls of op in one clean write+read round trip. */
static uint64_t calls_of(ss_faults *f, int op, int fsync_on)
{
    ss_faults_reset(f);
    roundtrip(ss_faults_os(f), fsync_on);
    return ss_faults_calls(f, op);
}

static void test_fault_matrix(void)
{
    static const char *const ops[] = {"open",      "ftruncate", "pwrite",
                                      "writeback", "fsync",     "close",
                                      "fstat",     "pread"};
    static const int errs[] = {ENOSPC, EIO};
    ss_faults *f = NULL;
    CHECK_EQ_INT(ss_faults_new(&f, NULL), 0);
    for (size_t oi = 0; oi < sizeof ops / sizeof *ops; oi++) {
        int op = ss_os_op_from_name(ops[oi]);
        uint64_t last = calls_of(f, op, 1);
        CHECK(last >= 2);
        uint64_t ks[] = {1, 2, last};
        for (size_t ei = 0; ei < 2; ei++) {
            for (size_t ki = 0; ki < 3; ki++) {
                ss_errinfo e;
                int fds = count_fds();
                ss_faults_reset(f);
                CHECK_EQ_INT(ss_faults_fail(f, op, ks[ki], errs[ei]), 0);
                ss_io_opts o = opts_piece();
                o.fsync = 1;
                o.writeback = 1;
                /* the op fails in the write or in the read */
                int rc = ss_io_write(ss_faults_os(f), pool, paths, NFILES,
                                     wjobs, NJOBS, &o, NULL, &e);
                if (rc == 0)
                    rc = ss_io_read(ss_faults_os(f), pool, paths, NFILES, rjobs,
                                    NJOBS, &o, NULL, &e);
                if (rc != -errs[ei])
                    fprintf(stderr, "  op %s k=%llu: rc %d\n", ops[oi],
                            (unsigned long long)ks[ki], rc);
                CHECK_EQ_INT(rc, -errs[ei]);
                CHECK_EQ_INT(e.sys_errno, errs[ei]);
                CHECK(e.op != NULL && strcmp(e.op, ops[oi]) == 0);
                CHECK(e.path[0] != '\0');
                CHECK_EQ_INT(count_fds(), fds);
                roundtrip(NULL, 0); /* still usable */
            }
        }
    }
    ss_faults_free(f);
}

/* writeback is a hint: "not supported here" (or a signal) loses nothing. */
static void test_writeback_unsupported(void)
{
    static const int errs[] = {EINVAL, ENOSYS, EOPNOTSUPP, EINTR};
    ss_faults *f = NULL;
    CHECK_EQ_INT(ss_faults_new(&f, NULL), 0);
    uint64_t last = calls_of(f, SS_OS_WRITEBACK, 1);
    CHECK(last >= 2);
    for (size_t ei = 0; ei < sizeof errs / sizeof *errs; ei++) {
        ss_faults_reset(f);
        CHECK_EQ_INT(ss_faults_fail(f, SS_OS_WRITEBACK, 1, errs[ei]), 0);
        CHECK_EQ_INT(ss_faults_fail(f, SS_OS_WRITEBACK, last, errs[ei]), 0);
        roundtrip(ss_faults_os(f), 1);
        CHECK_EQ_INT(ss_faults_calls(f, SS_OS_WRITEBACK), last);
    }
    ss_faults_free(f);
}

/* Small jobs of one file, in order, with small gaps: read by preadv runs.
 * Reads land right (CRCs too), across run limits, and every preadv fault
 * (error, short transfer, EINTR) is handled as pread's are. */
static void test_coalesced_reads(void)
{
    enum { N = 150 }; /* > SS_OS_MAX_IOV / 2: at least two runs */
    static unsigned char src_c[N][300], dst_c[N][300];
    ss_io_wjob w[N];
    ss_io_rjob r[N];
    uint32_t crc[N], got[N];
    int64_t off = 0;
    ss_errinfo e;
    ss_io_opts o = SS_IO_OPTS_INIT;
    ss_faults *f = NULL;

    for (int j = 0; j < N; j++) {
        size_t len = (size_t)rnd_in(j % 5 == 0 ? 0 : 1, 300);
        for (size_t i = 0; i < len; i++)
            src_c[j][i] = (unsigned char)rnd();
        off += rnd_in(0, 64); /* gaps, as zip headers leave between records */
        w[j] = (ss_io_wjob){src_c[j], len, 0, off};
        r[j] = (ss_io_rjob){dst_c[j], len, 0, off, 0, 0};
        off += (int64_t)len;
    }
    CHECK_EQ_INT(ss_io_write(NULL, pool, paths, 1, w, N, &o, crc, &e), 0);
    for (int j = 0; j < N; j++) {
        r[j].crc = crc[j];
        r[j].has_crc = 1;
    }
    CHECK_EQ_INT(ss_faults_new(&f, NULL), 0);
    CHECK_EQ_INT(ss_io_read(ss_faults_os(f), pool, paths, 1, r, N, &o, got, &e),
                 0);
    uint64_t runs = ss_faults_calls(f, SS_OS_PREADV);
    CHECK(runs >= 2 && runs <= 4);
    CHECK_EQ_INT(ss_faults_calls(f, SS_OS_PREAD), 0);
    for (int j = 0; j < N; j++) {
        CHECK_EQ_INT(got[j], crc[j]);
        CHECK(memcmp(src_c[j], dst_c[j], w[j].len) == 0);
    }
    /* a failing preadv names the file and the run's first job */
    static const int errs[] = {EIO, ENOMEM};
    for (size_t ei = 0; ei < 2; ei++) {
        for (uint64_t k = 1; k <= runs; k++) {
            int fds = count_fds();
            ss_faults_reset(f);
            CHECK_EQ_INT(ss_faults_fail(f, SS_OS_PREADV, k, errs[ei]), 0);
            CHECK_EQ_INT(
                ss_io_read(ss_faults_os(f), pool, paths, 1, r, N, &o, NULL, &e),
                -errs[ei]);
            CHECK(strcmp(e.op, "preadv") == 0 && strcmp(e.path, paths[0]) == 0);
            CHECK(e.job >= 0 && e.job < N);
            CHECK_EQ_INT(count_fds(), fds);
        }
    }
    /* short transfers (cut inside a gap, a job, or to 1 byte) and EINTR */
    static const size_t cuts[] = {1, 7, 301, 1000};
    for (size_t c = 0; c < 4; c++) {
        memset(dst_c, 0xEE, sizeof dst_c);
        ss_faults_reset(f);
        CHECK_EQ_INT(ss_faults_short(f, SS_OS_PREADV, 1, cuts[c]), 0);
        CHECK_EQ_INT(ss_faults_eintr(f, SS_OS_PREADV, 2), 0);
        CHECK_EQ_INT(
            ss_io_read(ss_faults_os(f), pool, paths, 1, r, N, &o, got, &e), 0);
        for (int j = 0; j < N; j++)
            CHECK(memcmp(src_c[j], dst_c[j], w[j].len) == 0 &&
                  got[j] == crc[j]);
    }
    /* a run that meets the end of the file early is SS_ESHORT */
    ss_faults_reset(f);
    CHECK_EQ_INT(ss_faults_short(f, SS_OS_PREADV, 1, 0), 0);
    CHECK_EQ_INT(
        ss_io_read(ss_faults_os(f), pool, paths, 1, r, N, &o, NULL, &e),
        SS_ESHORT);
    ss_faults_free(f);
}

static void test_short_and_eintr(void)
{
    static const char *const ops[] = {"pwrite", "pread"};
    ss_faults *f = NULL;
    CHECK_EQ_INT(ss_faults_new(&f, NULL), 0);
    for (int oi = 0; oi < 2; oi++) {
        int op = ss_os_op_from_name(ops[oi]);
        uint64_t last = calls_of(f, op, 0);
        uint64_t ks[] = {1, 2, last / 2, last};
        for (int ki = 0; ki < 4; ki++) {
            ss_faults_reset(f);
            CHECK_EQ_INT(ss_faults_short(f, op, ks[ki], 1), 0);
            CHECK_EQ_INT(ss_faults_eintr(f, op, ks[ki] + 1), 0);
            CHECK_EQ_INT(ss_faults_eintr(f, SS_OS_OPEN, 1), 0);
            CHECK_EQ_INT(ss_faults_eintr(f, SS_OS_FSYNC, 1), 0);
            roundtrip(ss_faults_os(f), 1);
            /* the short call's continuation and the EINTR retry (no
             * piece is a single byte) */
            CHECK_EQ_INT(ss_faults_calls(f, op), last + 2);
        }
    }
    /* a read that ends early (file shrank) is SS_ESHORT, not a hang */
    ss_errinfo e;
    ss_io_opts o = opts_piece();
    ss_faults_reset(f);
    ss_faults_short(f, SS_OS_PREAD, 3, 0);
    CHECK_EQ_INT(ss_io_read(ss_faults_os(f), pool, paths, NFILES, rjobs, NJOBS,
                            &o, NULL, &e),
                 SS_ESHORT);
    CHECK(strcmp(e.op, "pread") == 0);
    CHECK_EQ_INT(ss_faults_short(f, SS_OS_OPEN, 1, 5), SS_EINVAL);
    CHECK_EQ_INT(ss_faults_fail(f, SS_OS_OPEN, 0, EIO), SS_EINVAL);
    CHECK_EQ_INT(ss_faults_fail(f, -1, 1, EIO), SS_EINVAL);
    ss_faults_free(f);
}

/* A vtable whose first pread truncates the file first: a real shrink. */
static int64_t shrinking_pread(const ss_os *os, int fd, void *buf, size_t n,
                               int64_t off)
{
    const ss_os *base = ss_os_default();
    int *done = os->ctx;
    if (!*done) {
        *done = 1;
        CHECK_EQ_INT(truncate(paths[0], 10), 0);
    }
    return base->pread(base, fd, buf, n, off);
}

static void test_file_shrinks_during_read(void)
{
    int done = 0;
    ss_os os = *ss_os_default();
    ss_errinfo e;
    ss_io_opts o = opts_piece();
    os.ctx = &done;
    os.pread = shrinking_pread;
    roundtrip(NULL, 0);
    /* serial: the first read (of file 1) shrinks file 0 under later jobs */
    CHECK_EQ_INT(
        ss_io_read(&os, NULL, paths, NFILES, rjobs, NJOBS, &o, NULL, &e),
        SS_ESHORT);
    CHECK(strcmp(e.path, paths[0]) == 0);
    CHECK(strcmp(e.op, "pread") == 0);
}

static void read_file(const char *p, char *buf, size_t cap)
{
    int fd = open(p, O_RDONLY);
    ssize_t n = fd < 0 ? -1 : read(fd, buf, cap - 1);
    buf[n < 0 ? 0 : n] = '\0';
    if (fd >= 0)
        close(fd);
}

static void test_publish(void)
{
    char p[128], sub[96], got[64];
    ss_errinfo e;
    snprintf(sub, sizeof sub, "%s/pub", dir);
    mkdir(sub, 0777);
    snprintf(p, sizeof p, "%s/meta", sub);
    CHECK_EQ_INT(ss_file_publish(NULL, p, "old", 3, 1, &e), 0);
    read_file(p, got, sizeof got);
    CHECK(strcmp(got, "old") == 0);
    CHECK_EQ_INT(count_entries(sub), 1);

    static const char *const ops[] = {"open", "pwrite", "fsync", "close",
                                      "rename"};
    ss_faults *f = NULL;
    CHECK_EQ_INT(ss_faults_new(&f, NULL), 0);
    for (size_t i = 0; i < sizeof ops / sizeof *ops; i++) {
        int fds = count_fds();
        ss_faults_reset(f);
        ss_faults_fail(f, ss_os_op_from_name(ops[i]), 1, EIO);
        CHECK_EQ_INT(ss_file_publish(ss_faults_os(f), p, "new!", 4, 1, &e),
                     -EIO);
        CHECK(strcmp(e.op, ops[i]) == 0);
        CHECK(strcmp(e.path, p) == 0);
        read_file(p, got, sizeof got);
        CHECK(strcmp(got, "old") == 0);
        CHECK_EQ_INT(count_entries(sub), 1);
        CHECK_EQ_INT(count_fds(), fds);
    }
    /* the directory fsync comes after the rename: new content, an error */
    ss_faults_reset(f);
    ss_faults_fail(f, SS_OS_FSYNC_DIR, 1, EIO);
    CHECK_EQ_INT(ss_file_publish(ss_faults_os(f), p, "new!", 4, 1, &e), -EIO);
    CHECK(strcmp(e.op, "fsync_dir") == 0);
    CHECK_EQ_INT(count_entries(sub), 1);
    /* short writes and EINTR are absorbed */
    ss_faults_reset(f);
    ss_faults_short(f, SS_OS_PWRITE, 1, 2);
    ss_faults_eintr(f, SS_OS_PWRITE, 2);
    ss_faults_eintr(f, SS_OS_RENAME, 1);
    CHECK_EQ_INT(ss_file_publish(ss_faults_os(f), p, "fresh", 5, 1, &e), 0);
    read_file(p, got, sizeof got);
    CHECK(strcmp(got, "fresh") == 0);
    CHECK_EQ_INT(ss_faults_calls(f, SS_OS_PWRITE), 3);
    CHECK_EQ_INT(count_entries(sub), 1);
    ss_faults_free(f);
    unlink(p);
    rmdir(sub);
}

static void test_raw(void)
{
    size_t n = 3 * PIECE + 17;
    unsigned char *a = malloc(n), *b = malloc(n);
    char p[128];
    for (size_t i = 0; i < n; i++)
        a[i] = (unsigned char)(i * 7);
    snprintf(p, sizeof p, "%s/raw", dir);
    CHECK_EQ_INT(ss_io_raw_pwrite(p, a, n, PIECE), 0);
    CHECK_EQ_INT(ss_io_raw_pread(p, b, n, PIECE), 0);
    CHECK(memcmp(a, b, n) == 0);
    CHECK_EQ_INT(ss_io_raw_pread(p, b, n + 1, 0), SS_ESHORT);
    unlink(p);
    free(a);
    free(b);
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/ss_test_io.XXXXXX");
    if (mkdtemp(dir) == NULL)
        return 2;
    for (int i = 0; i < NFILES; i++) {
        snprintf(path_buf[i], sizeof path_buf[i], "%s/f%d", dir, i);
        paths[i] = path_buf[i];
    }
    setup_jobs();
    ss_pool_new(&pool, 3);
    RUN(test_roundtrip);
    RUN(test_checksum_off_and_gaps);
    RUN(test_checksum_mismatch);
    RUN(test_range_and_validation);
    RUN(test_fault_matrix);
    RUN(test_writeback_unsupported);
    RUN(test_coalesced_reads);
    RUN(test_short_and_eintr);
    RUN(test_file_shrinks_during_read);
    RUN(test_publish);
    RUN(test_raw);
    ss_pool_free(pool);
    for (int i = 0; i < NFILES; i++)
        unlink(paths[i]);
    for (int j = 0; j < NJOBS; j++) {
        free(src[j]);
        free(dst[j]);
    }
    rmdir(dir);
    return ss_test_report("io");
}
