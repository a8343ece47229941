/* test_recmem.c - ss_recmem: records framed by ss_io_write_records into
 * caller buffers, byte for byte as into a file; writes past a buffer's
 * end, bad paths and reads. */
#include "ss_crc.h"
#include "ss_recmem.h"
#include "ss_recwrite.h"
#include "ss_test.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static void test_records_into_buffers(void)
{
    const int64_t shape[] = {40, 50};
    ss_zip_plan *p = NULL;
    float *data = malloc(2000 * sizeof *data);
    uint8_t item[] = "bytes item";
    uint8_t *b0, *b1 = calloc(16, 1);
    uint32_t crcs[3];
    ss_errinfo e;
    ss_pool *pool = NULL;

    for (int i = 0; i < 2000; i++)
        data[i] = (float)i;
    CHECK_EQ_INT(ss_zip_plan_new("float32", 2, shape, NULL, -1, &p), 0);
    size_t hl, tl, total = (size_t)ss_zip_plan_total_length(p);
    const uint8_t *h = ss_zip_plan_header(p, &hl);
    (void)ss_zip_plan_trailer(p, &tl);
    b0 = calloc(total + 10, 1);
    ss_memfile files[] = {{b0, total + 10}, {b1, 16}};
    ss_memos m;
    ss_memos_init(&m, files, 2);
    const char *paths[] = {"mem:0", "mem:1"};
    ss_io_record recs[] = {
        {item, 10, 0, 0, NULL, 0},
        {data, 8000, 0, 10, p, 0},
        {item, 10, 1, 6, NULL, 0},
    };
    ss_io_opts o = SS_IO_OPTS_INIT;
    o.piece = 1024; /* the data in pieces, on the pool */
    CHECK_EQ_INT(ss_pool_new(&pool, 3), 0);
    CHECK_EQ_INT(ss_io_write_records(ss_memos_os(&m), pool, paths, 2, recs, 3,
                                     &o, 0, crcs, &e),
                 0);
    CHECK(memcmp(b0, item, 10) == 0 && memcmp(b0 + 10, h, hl) == 0);
    CHECK(memcmp(b0 + 10 + hl, data, 8000) == 0);
    CHECK_EQ_INT(crcs[1], ss_crc32(0, data, 8000));
    uint8_t *t = malloc(tl);
    memcpy(t, ss_zip_plan_trailer(p, &tl), tl);
    ss_zip_plan_patch(p, t, crcs[1]);
    CHECK(memcmp(b0 + 10 + hl + 8000, t, tl) == 0);
    CHECK(memcmp(b1 + 6, item, 10) == 0);

    /* one byte past the end of buffer 1: EFBIG, nothing grows */
    recs[2].offset = 7;
    CHECK_EQ_INT(ss_io_write_records(ss_memos_os(&m), pool, paths, 2, recs, 3,
                                     &o, 0, crcs, &e),
                 -EFBIG);
    /* a path that names no buffer */
    const char *bad[] = {"mem:0", "mem:2"};
    recs[2].offset = 0;
    CHECK_EQ_INT(ss_io_write_records(ss_memos_os(&m), pool, bad, 2, recs, 3, &o,
                                     0, crcs, &e),
                 -ENOENT);
    /* reads: up to the end, then nothing */
    const ss_os *os = ss_memos_os(&m);
    uint8_t got[8];
    CHECK_EQ_INT(os->open(os, "mem:1", 0, 0), 1);
    CHECK_EQ_INT(os->open(os, "mem:01", 0, 0), -ENOENT);
    CHECK_EQ_INT(os->pread(os, 1, got, 8, 12), 4);
    CHECK(memcmp(got, item + 6, 4) == 0);
    CHECK_EQ_INT(os->pread(os, 1, got, 8, 16), 0);
    CHECK_EQ_INT(os->pwrite(os, 2, got, 1, 0), -EBADF);
    ss_pool_free(pool);
    ss_zip_plan_free(p);
    free(t);
    free(b0);
    free(b1);
    free(data);
}

int main(void)
{
    RUN(test_records_into_buffers);
    return ss_test_report("recmem");
}
