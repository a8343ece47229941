/* test_zipwrite.c - ss_zipwrite's hashes, plans and trailer patch, and
 * ss_io_write_records: a file of packed, big, empty and plain items is
 * header + data + patched trailer for each, a file with no item is
 * created empty, bad tables are refused before anything is written, and
 * a fault in the trailer batch fails the call. Expected values are
 * _zipfmt.py's (_std_hash, _hash_combine, plan_tensor_record: lengths and
 * CRC-32s of its bytes). */
#include "ss_crc.h"
#include "ss_recwrite.h"
#include "ss_os.h"
#include "ss_test.h"
#include "ss_zipwrite.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void test_hashes(void)
{
    static const struct {
        const char *s;
        uint64_t h;
    } cases[] = {
        {"", 0x553e93901e462a6eull},
        {"a", 0x454ddee488c1ed6bull},
        {"data.pkl", 0x44943d565847b09eull},
        {".data/serialization_id", 0x5bc341cb869e133eull},
        {"0123456789abcdef!", 0x3342474da4e141faull},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        CHECK(ss_zip_std_hash(cases[i].s, strlen(cases[i].s)) == cases[i].h);
    CHECK(ss_zip_hash_combine(0x1234, 0xdeadbeef) == 0x17ce9d801ull);
}

static uint32_t crc_of(const void *p, size_t n)
{
    return ss_crc32(0, p, n);
}

static void test_plan_bytes(void)
{
    const int64_t shape[] = {2, 3}, empty[] = {5, 0, 3};
    ss_zip_plan *p = NULL;
    size_t hl, tl;

    CHECK_EQ_INT(ss_zip_plan_new("float32", 2, shape, NULL, -1, &p), 0);
    const uint8_t *h = ss_zip_plan_header(p, &hl);
    const uint8_t *t = ss_zip_plan_trailer(p, &tl);
    CHECK_EQ_INT(hl, 704);
    CHECK(crc_of(h, hl) == 0xa56758a5u);
    CHECK_EQ_INT(ss_zip_plan_data_length(p), 24);
    CHECK_EQ_INT(ss_zip_plan_total_length(p), 704 + 24 + tl);
    uint8_t *buf = malloc(tl);
    memcpy(buf, t, tl);
    ss_zip_plan_patch(p, buf, 0xdeadbeef); /* any CRC first: patches compose */
    ss_zip_plan_patch(p, buf, 0x12345678);
    CHECK_EQ_INT(tl, 849);
    CHECK(crc_of(buf, tl) == 0xeeb5d3b5u);
    CHECK(memcmp(buf, "PK\x07\x08\x78\x56\x34\x12", 8) == 0);
    ss_zip_plan_patch(p, buf, 0); /* CRC 0 is the template */
    CHECK(memcmp(buf, t, tl) == 0);
    free(buf);
    ss_zip_plan_free(p);

    /* an empty storage: no descriptor, the trailer ignores the CRC */
    CHECK_EQ_INT(ss_zip_plan_new("torch.uint16", 3, empty, NULL, -1, &p), 0);
    h = ss_zip_plan_header(p, &hl);
    t = ss_zip_plan_trailer(p, &tl);
    CHECK_EQ_INT(hl, 768);
    CHECK(crc_of(h, hl) == 0x9531ebb6u);
    CHECK_EQ_INT(tl, 809);
    CHECK(crc_of(t, tl) == 0x9a42f74du);
    buf = malloc(tl);
    memcpy(buf, t, tl);
    ss_zip_plan_patch(p, buf, 0x12345678);
    CHECK(memcmp(buf, t, tl) == 0);
    free(buf);
    ss_zip_plan_free(p);
    ss_zip_plan_free(NULL);
}

static void test_plan_refusals(void)
{
    const int64_t shape[] = {3, 4}, neg[] = {-1, 4}, stride[] = {8, 2};
    ss_zip_plan *p = (ss_zip_plan *)&p;
    CHECK_EQ_INT(ss_zip_plan_new("float33", 2, shape, NULL, -1, &p), SS_EINVAL);
    CHECK(p == NULL);
    CHECK_EQ_INT(ss_zip_plan_new("float32", 2, neg, NULL, -1, &p), SS_EINVAL);
    /* strides reach element 2*8 + 3*2 = 22: 22 elements are too few */
    CHECK_EQ_INT(ss_zip_plan_new("float32", 2, shape, stride, 22, &p),
                 SS_EINVAL);
    CHECK_EQ_INT(ss_zip_plan_new("float32", 2, shape, stride, 23, &p), 0);
    CHECK_EQ_INT(ss_zip_plan_data_length(p), 23 * 4);
    ss_zip_plan_free(p);
    CHECK_EQ_INT(
        ss_zip_plan_new("float32", SS_ZIP_MAX_NDIM + 1, shape, NULL, -1, &p),
        SS_EINVAL);
}

/* ---- ss_io_write_records ------------------------------------------------- */

static char dir[64];
static char path0[96], path1[96];

/* The whole file at path (caller frees), its length in *n. */
static uint8_t *slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    uint8_t *p = NULL;
    long len;
    if (f == NULL)
        return NULL;
    fseek(f, 0, SEEK_END);
    len = ftell(f);
    fseek(f, 0, SEEK_SET);
    p = malloc(len ? (size_t)len : 1);
    *n = fread(p, 1, (size_t)len, f);
    fclose(f);
    return p;
}

/* Append record (plan, data) to out at *at, as the engine should. */
static void expect_record(uint8_t *out, size_t *at, const ss_zip_plan *p,
                          const uint8_t *data)
{
    size_t hl, tl;
    const uint8_t *h = ss_zip_plan_header(p, &hl);
    const uint8_t *t = ss_zip_plan_trailer(p, &tl);
    uint64_t n = ss_zip_plan_data_length(p);
    memcpy(out + *at, h, hl);
    if (n > 0)
        memcpy(out + *at + hl, data, (size_t)n);
    memcpy(out + *at + hl + n, t, tl);
    ss_zip_plan_patch(p, out + *at + hl + n,
                      n ? ss_crc32(0, data, (size_t)n) : 0);
    *at += hl + n + tl;
}

#define NREC 7

static void test_write_records(void)
{
    const int64_t small[] = {3, 5}, big[] = {200, 100}, none[] = {0, 3};
    ss_zip_plan *ps = NULL, *pb = NULL, *pe = NULL;
    const char *paths[] = {path0, path1};
    uint8_t bytes_item[] = "\x80\x02K\x03.";
    float *a = malloc(15 * sizeof *a), *b = malloc(20000 * sizeof *b);
    uint8_t *want = malloc(1 << 20);
    size_t at = 0, n = 0;
    uint32_t crcs[NREC];
    ss_errinfo e;

    for (int i = 0; i < 15; i++)
        a[i] = (float)i * 0.5f;
    for (int i = 0; i < 20000; i++)
        b[i] = (float)i;
    CHECK_EQ_INT(ss_zip_plan_new("float32", 2, small, NULL, -1, &ps), 0);
    CHECK_EQ_INT(ss_zip_plan_new("float32", 2, big, NULL, -1, &pb), 0);
    CHECK_EQ_INT(ss_zip_plan_new("float32", 2, none, NULL, -1, &pe), 0);
    /* file 0: bytes item, small, small, big, empty, small (a run broken
     * by the big record); file 1 gets no item */
    ss_io_record recs[NREC];
    int64_t off = 0;
    recs[0] = (ss_io_record){bytes_item, 5, 0, off, NULL, 0};
    off += 5;
    const ss_zip_plan *order[] = {ps, ps, pb, pe, ps, ps};
    for (int k = 1; k < NREC; k++) {
        const ss_zip_plan *p = order[k - 1];
        const void *src = p == pb ? (const void *)b : p == pe ? NULL : a;
        recs[k] = (ss_io_record){src, ss_zip_plan_data_length(p), 0, off, p, 0};
        off += (int64_t)ss_zip_plan_total_length(p);
    }
    memcpy(want, bytes_item, 5);
    at = 5;
    for (int k = 1; k < NREC; k++)
        expect_record(want, &at, recs[k].plan, recs[k].src);
    CHECK_EQ_INT(at, off);

    ss_pool *pool = NULL;
    CHECK_EQ_INT(ss_pool_new(&pool, 3), 0);
    /* default runs, then one record per run (run tasks on a pool) */
    for (uint64_t run = 0; run <= 1; run++) {
        ss_io_opts o = SS_IO_OPTS_INIT;
        o.fsync = 1;
        o.piece = 4096; /* the big record's data in pieces, on the pool */
        unlink(path1);
        CHECK_EQ_INT(ss_io_write_records(NULL, pool, paths, 2, recs, NREC, &o,
                                         run, crcs, &e),
                     0);
        uint8_t *got = slurp(path0, &n);
        CHECK_EQ_INT(n, at);
        CHECK(got != NULL && memcmp(got, want, at) == 0);
        free(got);
        got = slurp(path1, &n);
        CHECK(got != NULL && n == 0);
        free(got);
        CHECK(crcs[0] == ss_crc32(0, bytes_item, 5));
        CHECK(crcs[1] == ss_crc32(0, a, 60) && crcs[6] == crcs[1]);
        CHECK(crcs[3] == ss_crc32(0, b, 80000));
        CHECK_EQ_INT(crcs[4], 0);
    }
    ss_pool_free(pool);

    /* bad tables: refused with the record's index, nothing written */
    ss_io_record bad[2] = {recs[1], recs[2]};
    bad[1].len = 12;
    unlink(path0);
    CHECK_EQ_INT(
        ss_io_write_records(NULL, NULL, paths, 2, bad, 2, NULL, 0, NULL, &e),
        SS_EINVAL);
    CHECK_EQ_INT(e.job, 1);
    CHECK(access(path0, F_OK) != 0);
    bad[1] = recs[2];
    bad[1].file = 2;
    CHECK_EQ_INT(
        ss_io_write_records(NULL, NULL, paths, 2, bad, 2, NULL, 0, NULL, &e),
        SS_EINVAL);
    bad[1] = recs[2];
    bad[1].offset = -1;
    CHECK_EQ_INT(
        ss_io_write_records(NULL, NULL, paths, 2, bad, 2, NULL, 0, NULL, &e),
        SS_EINVAL);
    bad[1] = recs[3];
    bad[1].dev = 1; /* no stage */
    CHECK_EQ_INT(
        ss_io_write_records(NULL, NULL, paths, 2, bad, 2, NULL, 0, NULL, &e),
        SS_EINVAL);

    /* a failure after the data (the big record's trailer write, the last
     * pwrite; or the last fsync) fails the call */
    ss_faults *f = NULL;
    CHECK_EQ_INT(ss_faults_new(&f, NULL), 0);
    ss_io_opts o = SS_IO_OPTS_INIT;
    o.fsync = 1;
    int ops[] = {ss_os_op_from_name("pwrite"), ss_os_op_from_name("fsync"),
                 ss_os_op_from_name("open")};
    for (size_t i = 0; i < sizeof ops / sizeof *ops; i++) {
        ss_faults_reset(f);
        CHECK_EQ_INT(ss_io_write_records(ss_faults_os(f), NULL, paths, 2, recs,
                                         NREC, &o, 0, crcs, &e),
                     0);
        uint64_t last = ss_faults_calls(f, ops[i]);
        ss_faults_reset(f);
        CHECK_EQ_INT(ss_faults_fail(f, ops[i], last, EIO), 0);
        int fds = count_fds();
        CHECK_EQ_INT(ss_io_write_records(ss_faults_os(f), NULL, paths, 2, recs,
                                         NREC, &o, 0, crcs, &e),
                     -EIO);
        CHECK_EQ_INT(count_fds(), fds);
    }
    ss_faults_free(f);

    ss_zip_plan_free(ps);
    ss_zip_plan_free(pb);
    ss_zip_plan_free(pe);
    free(a);
    free(b);
    free(want);
}

int main(void)
{
    strcpy(dir, "/tmp/ss_zipwrite_XXXXXX");
    if (mkdtemp(dir) == NULL)
        return 2;
    snprintf(path0, sizeof path0, "%s/a.distcp", dir);
    snprintf(path1, sizeof path1, "%s/b.distcp", dir);
    RUN(test_hashes);
    RUN(test_plan_bytes);
    RUN(test_plan_refusals);
    RUN(test_write_records);
    unlink(path0);
    unlink(path1);
    rmdir(dir);
    return ss_test_report("zipwrite");
}
