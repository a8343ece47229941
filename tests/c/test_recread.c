/* test_recread.c - ss_io_read_recs: range reads verified whole, scatter
 * reads, table validation, discard jobs of ss_io_read. */
#include "ss_crc.h"
#include "ss_io.h"
#include "ss_recread.h"
#include "ss_test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FSIZE 20000
static char dir[64], path[128];
static const char *paths[1];
static unsigned char data[FSIZE];
static ss_pool *pool;

static void write_file(void)
{
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    CHECK(fwrite(data, 1, FSIZE, f) == FSIZE);
    fclose(f);
}

/* A record's data at [off, off + len) of the file. */
static ss_io_rec range_rec(int64_t off, uint64_t len, uint64_t start,
                           uint64_t count, void *dst, int whole)
{
    ss_io_rec r = {0};
    r.kind = SS_IO_REC_RANGE;
    r.offset = off;
    r.len = len;
    r.crc = ss_crc32(0, data + off, len);
    r.whole = whole;
    r.dst = dst;
    r.dst_len = count;
    r.start = start;
    r.count = count;
    return r;
}

static ss_io_opts small_pieces(void)
{
    ss_io_opts o = SS_IO_OPTS_INIT;
    o.piece = 1000; /* rests span several discard pieces */
    o.checksum = 0;
    return o;
}

static void test_range_verified_whole(void)
{
    unsigned char a[3000], b[500], c[7000];
    ss_io_rec r[3] = {
        range_rec(100, 7000, 2000, 3000, a, 1), /* middle */
        range_rec(9000, 4000, 0, 500, b, 1),    /* head */
        range_rec(13000, 7000, 0, 7000, c, 1),  /* whole */
    };
    ss_io_opts o = small_pieces();
    uint32_t crcs[3];
    ss_errinfo e;

    CHECK_EQ_INT(
        ss_io_read_recs(NULL, pool, paths, 1, r, 3, &o, 1 << 20, crcs, &e), 0);
    CHECK(memcmp(a, data + 2100, 3000) == 0);
    CHECK(memcmp(b, data + 9000, 500) == 0);
    CHECK(memcmp(c, data + 13000, 7000) == 0);
    CHECK_EQ_INT(crcs[0], ss_crc32(0, data + 2100, 3000));
    CHECK_EQ_INT(crcs[1], ss_crc32(0, data + 9000, 500));
    CHECK_EQ_INT(crcs[2], r[2].crc);

    /* a byte outside the range read, inside the record: caught, item 0 */
    data[150] ^= 1;
    write_file();
    CHECK_EQ_INT(
        ss_io_read_recs(NULL, pool, paths, 1, r, 3, &o, 1 << 20, crcs, &e),
        SS_ECHECKSUM);
    CHECK_EQ_INT(e.job, 0);
    /* not verified whole (the ranks check it together): only read */
    r[0].whole = 0;
    CHECK_EQ_INT(
        ss_io_read_recs(NULL, pool, paths, 1, r, 3, &o, 1 << 20, crcs, &e), 0);
    CHECK_EQ_INT(crcs[0], ss_crc32(0, data + 2100, 3000));
    /* in the tail of item 1's record */
    data[150] ^= 1;
    data[12999] ^= 1;
    write_file();
    CHECK_EQ_INT(
        ss_io_read_recs(NULL, pool, paths, 1, r, 3, &o, 1 << 20, crcs, &e),
        SS_ECHECKSUM);
    CHECK_EQ_INT(e.job, 1);
    o.verify = 0; /* verify off: nothing checked */
    CHECK_EQ_INT(
        ss_io_read_recs(NULL, pool, paths, 1, r, 3, &o, 1 << 20, crcs, &e), 0);
    data[12999] ^= 1;
    write_file();
}

static void test_scatter(void)
{
    /* two records of int32 6 x 5 (row-major), regions [1:4, 2:4] copied
     * into a transposed 2 x 3 destination (column strides) */
    int32_t src[30], out[2][2 * 3];
    int64_t sizes[2] = {3, 2}, sst[2] = {20, 4}, dst_st[2] = {4, 12};
    ss_io_rec r[2];
    uint32_t crcs[2];
    ss_errinfo e;
    ss_io_opts o = small_pieces();

    for (int k = 0; k < 2; k++) {
        memset(&r[k], 0, sizeof r[k]);
        r[k].kind = SS_IO_REC_SCATTER;
        r[k].offset = 1000 + 4000 * k;
        r[k].len = sizeof src;
        r[k].crc = ss_crc32(0, data + r[k].offset, sizeof src);
        r[k].dst = out[k];
        r[k].dst_len = sizeof out[k];
        r[k].ndim = 2;
        r[k].elsize = 4;
        r[k].src_off = (1 * 5 + 2) * 4;
        r[k].sizes = sizes;
        r[k].src_strides = sst;
        r[k].dst_strides = dst_st;
    }
    /* scratch 1: each record in a round of its own */
    CHECK_EQ_INT(ss_io_read_recs(NULL, pool, paths, 1, r, 2, &o, 1, crcs, &e),
                 0);
    for (int k = 0; k < 2; k++) {
        memcpy(src, data + r[k].offset, sizeof src);
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 2; j++)
                CHECK_EQ_INT(out[k][j * 3 + i], src[(1 + i) * 5 + 2 + j]);
        CHECK_EQ_INT(crcs[k], r[k].crc);
    }
    data[5000 + 3] ^= 1;
    write_file();
    CHECK_EQ_INT(
        ss_io_read_recs(NULL, pool, paths, 1, r, 2, &o, 1 << 20, crcs, &e),
        SS_ECHECKSUM);
    CHECK_EQ_INT(e.job, 1);
    data[5000 + 3] ^= 1;
    write_file();
}

static void test_validation(void)
{
    unsigned char buf[64];
    int32_t out[6];
    int64_t sizes[2] = {3, 2}, sst[2] = {20, 4}, dst_st[2] = {4, 12};
    ss_io_rec ok = range_rec(0, 100, 10, 64, buf, 1), r[2];
    ss_errinfo e;

    r[0] = ok;
    r[1] = ok;
    r[1].file = 1;
    CHECK_EQ_INT(ss_io_read_recs(NULL, pool, paths, 1, r, 2, NULL, 1, NULL, &e),
                 SS_EINVAL);
    CHECK_EQ_INT(e.job, 1);
    r[1] = ok;
    r[1].start = 50; /* 50 + 64 > 100 */
    CHECK_EQ_INT(ss_io_read_recs(NULL, pool, paths, 1, r, 2, NULL, 1, NULL, &e),
                 SS_EINVAL);
    r[1] = ok;
    r[1].dst_len = 10; /* destination too small */
    CHECK_EQ_INT(ss_io_read_recs(NULL, pool, paths, 1, r, 2, NULL, 1, NULL, &e),
                 SS_EINVAL);
    r[1] = ok;
    r[1].kind = 7;
    CHECK_EQ_INT(ss_io_read_recs(NULL, pool, paths, 1, r, 2, NULL, 1, NULL, &e),
                 SS_EINVAL);
    CHECK(strstr(e.detail, "item 1") != NULL);

    memset(&r[1], 0, sizeof r[1]);
    r[1].kind = SS_IO_REC_SCATTER;
    r[1].len = 120;
    r[1].crc = ss_crc32(0, data, 120);
    r[1].dst = out;
    r[1].dst_len = sizeof out;
    r[1].ndim = 2;
    r[1].elsize = 4;
    r[1].src_off = 28;
    r[1].sizes = sizes;
    r[1].src_strides = sst;
    r[1].dst_strides = dst_st;
    CHECK_EQ_INT(ss_io_read_recs(NULL, pool, paths, 1, r, 2, NULL, 1, NULL, &e),
                 0);
    r[1].src_off = 100; /* 100 + 2 * 20 + 4 + 4 > 120 */
    CHECK_EQ_INT(ss_io_read_recs(NULL, pool, paths, 1, r, 2, NULL, 1, NULL, &e),
                 SS_EINVAL);
    r[1].src_off = 28;
    r[1].dst_len = 20; /* the transposed region reaches 24 bytes */
    CHECK_EQ_INT(ss_io_read_recs(NULL, pool, paths, 1, r, 2, NULL, 1, NULL, &e),
                 SS_EINVAL);
    r[1].dst_len = sizeof out;
    sst[0] = INT64_MAX / 2; /* extent overflows */
    CHECK_EQ_INT(ss_io_read_recs(NULL, pool, paths, 1, r, 2, NULL, 1, NULL, &e),
                 SS_EINVAL);
    sst[0] = 20;
    r[1].ndim = 65;
    CHECK_EQ_INT(ss_io_read_recs(NULL, pool, paths, 1, r, 2, NULL, 1, NULL, &e),
                 SS_EINVAL);
}

/* ss_io_read's discard jobs: a buffer is refused, the CRC is the bytes'. */
static void test_discard_jobs(void)
{
    ss_io_rjob j[2] = {{NULL, 5000, 0, 10, 0, 0, 0, 1},
                       {NULL, 300, 0, 6000, 0, 0, 0, 1}};
    ss_io_opts o = small_pieces();
    uint32_t crcs[2];
    ss_errinfo e;

    CHECK_EQ_INT(ss_io_read(NULL, pool, paths, 1, j, 2, &o, crcs, &e), 0);
    CHECK_EQ_INT(crcs[0], ss_crc32(0, data + 10, 5000));
    CHECK_EQ_INT(crcs[1], ss_crc32(0, data + 6000, 300));
    j[1].dst = data;
    CHECK_EQ_INT(ss_io_read(NULL, pool, paths, 1, j, 2, &o, crcs, &e),
                 SS_EINVAL);
}

/* Small records back to back, partly read: the range reads and the rests'
 * discard reads are coalesced into preadv runs (default piece size), each
 * record still checked whole. */
static void test_coalesced_partial_reads(void)
{
    enum { N = 40 };
    unsigned char out[N][30];
    ss_io_rec r[N];
    uint32_t crcs[N];
    ss_errinfo e;

    for (int k = 0; k < N; k++)
        r[k] = range_rec(120 * k, 100, 30, 30, out[k], 1);
    CHECK_EQ_INT(ss_io_read_recs(NULL, pool, paths, 1, r, N, NULL, 0, crcs, &e),
                 0);
    for (int k = 0; k < N; k++) {
        CHECK(memcmp(out[k], data + 120 * k + 30, 30) == 0);
        CHECK_EQ_INT(crcs[k], ss_crc32(0, data + 120 * k + 30, 30));
    }
    data[120 * 17 + 99] ^= 4; /* the last byte of record 17's rest */
    write_file();
    CHECK_EQ_INT(ss_io_read_recs(NULL, pool, paths, 1, r, N, NULL, 0, crcs, &e),
                 SS_ECHECKSUM);
    CHECK_EQ_INT(e.job, 17);
    data[120 * 17 + 99] ^= 4;
    write_file();
}

int main(void)
{
    int rc;
    snprintf(dir, sizeof dir, "/tmp/ss_recread_XXXXXX");
    if (mkdtemp(dir) == NULL)
        return 1;
    snprintf(path, sizeof path, "%s/f", dir);
    paths[0] = path;
    for (size_t i = 0; i < FSIZE; i++)
        data[i] = (unsigned char)(rnd() >> 56);
    write_file();
    ss_pool_new(&pool, 3);
    RUN(test_range_verified_whole);
    RUN(test_scatter);
    RUN(test_validation);
    RUN(test_discard_jobs);
    RUN(test_coalesced_partial_reads);
    ss_pool_free(pool);
    unlink(path);
    rmdir(dir);
    rc = ss_test_report("recread");
    return rc;
}
