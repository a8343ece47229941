/* ss_recread.h - a load's tensor record reads in one call.
 *
 * A load's reads of tensor records, as one call: a table of items, each
 * naming a record's data ([offset, offset + len) of a file, CRC-32 crc) and
 * what to do with it:
 *
 *  SS_IO_REC_RANGE: read [start, start + count) of the data into dst
 *    (count bytes; dst_len >= count; dev: dst is device memory, staged
 *    through opts->stage). With opts->verify and `whole`, the CRC of the
 *    whole record's data is checked: the rest is read into engine scratch
 *    for its CRC only (discard jobs) and the CRCs are combined.
 *  SS_IO_REC_SCATTER: read the whole data into engine scratch (checked with
 *    opts->verify), then copy the region sizes[0] x ... x sizes[ndim-1] of
 *    elsize-byte elements from data + src_off (src_strides, bytes) to dst
 *    (dst_strides, bytes; its extent inside [dst, dst + dst_len)).
 *    Scratch is taken in rounds of at most `scratch` bytes (a record larger
 *    than that has a round to itself); host memory only.
 *
 * crcs[i] (may be NULL) receives the CRC-32 of the bytes item i read into
 * its destination (RANGE: the range; SCATTER: the whole data), computed when
 * opts->checksum or opts->verify is on, else 0. Every entry is checked
 * before anything is read (SS_EINVAL naming the item as err->job: a file
 * index, a range or a region outside the record data or the destination).
 * A mismatch is SS_ECHECKSUM with err->job the item's index. Range reads run
 * as one ss_io_read batch, scatter rounds as one each; the GIL-free caller
 * sees one call. Thread safety as ss_io_read. */

#ifndef SS_RECREAD_H
#define SS_RECREAD_H

#include <stddef.h>
#include <stdint.h>

#include "ss_error.h"
#include "ss_io.h"

enum { SS_IO_REC_RANGE = 0, SS_IO_REC_SCATTER = 1 };

typedef struct ss_io_rec {
    uint32_t file;
    int kind;       /* SS_IO_REC_RANGE or SS_IO_REC_SCATTER */
    int64_t offset; /* file offset of the record's data */
    uint64_t len;   /* the record's data length */
    uint32_t crc;   /* the CRC-32 of the whole data (checked with verify) */
    int whole;      /* RANGE: verify the whole record, not just read */
    int dev;        /* RANGE: dst is device memory */
    void *dst;
    uint64_t dst_len;
    uint64_t start, count; /* RANGE */
    /* SCATTER: the region (ndim <= SS_IO_REC_MAX_NDIM; arrays of ndim) */
    int ndim;
    uint64_t elsize;
    int64_t src_off;
    const int64_t *sizes, *src_strides, *dst_strides;
} ss_io_rec;

#define SS_IO_REC_MAX_NDIM 64

int ss_io_read_recs(const ss_os *os, ss_pool *pool, const char *const *paths,
                    size_t npaths, const ss_io_rec *recs, size_t n,
                    const ss_io_opts *opts, uint64_t scratch, uint32_t *crcs,
                    ss_errinfo *err);

#endif /* SS_RECREAD_H */
