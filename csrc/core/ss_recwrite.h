/* ss_recwrite.h - a rank's torch.save records written in one call.
 *
 * ss_io_write_records writes a table of items: each is either a plain job
 * (bytes written as they are, a DCP bytes item) or a tensor record: the
 * storage bytes framed by a plan (ss_zipwrite.h) into header + data +
 * trailer, the trailer holding the data's CRC-32. The whole save of a
 * rank's files is this one call:
 *
 *   1. Small records (host memory, at most SS_IO_PACK_RECORD data bytes)
 *      that follow each other in one file (consecutive in the table, each
 *      starting where the previous one ends) are laid out whole in one
 *      buffer per run of about pack_run bytes (0 = SS_IO_PACK_RUN: a run
 *      ends after the record that takes it past that), a pool task per
 *      run: header and data copied, the data's CRC taken on the copy, the
 *      trailer patched in place. Many small tensors otherwise cost three
 *      jobs and a trailer each, which is what such a save spends its time
 *      on.
 *   2. One ss_io_write batch (files created or truncated, every file of
 *      the table opened, so a file with no item is created empty): each
 *      run, each plain job, and for every other record its header and its
 *      data (a device record's through opts->stage), CRCs computed next to
 *      the transfers.
 *   3. Each other record's trailer, patched in C for its data job's CRC,
 *      is written by a second batch that opens the files in place
 *      (ss_io_opts.patch: no truncation) and, with opts->fsync, fsyncs
 *      every file of the table. The batch is skipped when it has nothing
 *      to do.
 *
 * crcs (nrecs entries, may be NULL) receives each record's data CRC-32 (a
 * plain job's CRC when opts->checksum, else 0; 0 for empty data).
 *
 * Options: opts->fsync, writeback, stage, stream and piece as in
 * ss_io_write; checksum applies to plain jobs only (records are always
 * checksummed); patch must be 0. Errors: SS_EINVAL for a bad table (file
 * index, offset, a record's length not its plan's, a missing buffer; the
 * item's index in err->job, before anything is written), SS_ENOMEM, or
 * the first failure of a batch (err->job then names a job of that batch,
 * not an item). After a failure the files hold unspecified content; a
 * failure after step 2 leaves the records without their trailers.
 *
 * Thread safety: as ss_io_write. The plans are only read.
 */
#ifndef SS_RECWRITE_H
#define SS_RECWRITE_H

#include "ss_io.h"
#include "ss_zipwrite.h"

/* Records with at most this many data bytes are packed (step 1). */
#define SS_IO_PACK_RECORD ((uint64_t)64 << 10)
/* pack_run's default. */
#define SS_IO_PACK_RUN ((uint64_t)16 << 20)

typedef struct ss_io_record {
    const void *src; /* the data (a tensor's storage bytes, a bytes item) */
    uint64_t len;
    uint32_t file;           /* index into paths */
    int64_t offset;          /* where the record (or the job) starts */
    const ss_zip_plan *plan; /* NULL: a plain job */
    int dev;                 /* src is device memory (needs opts->stage) */
} ss_io_record;

int ss_io_write_records(const ss_os *os, ss_pool *pool,
                        const char *const *paths, size_t npaths,
                        const ss_io_record *recs, size_t nrecs,
                        const ss_io_opts *opts, uint64_t pack_run,
                        uint32_t *crcs, ss_errinfo *err);

#endif /* SS_RECWRITE_H */
