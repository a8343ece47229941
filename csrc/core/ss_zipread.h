/* ss_zipread.h - recognition of one torch.save tensor record (a DCP tensor
 * item) from its bytes, without unpickling anything.
 *
 * The reference is the Python parser (python/shardstate/checkpoint/
 * _zipfmt.py parse_record; docs/FORMAT.md): this one accepts a subset of
 * what it accepts, with the same results, and refuses everything else
 * (SS_EINVAL, the reason in err->detail), so a caller can fall back to the
 * reference on a refusal and must never trust a record this refuses. The
 * subset: the zip layout torch's writer makes (zip64 end records, stored
 * entries back to back from offset 0, data descriptors, entry names of
 * printable ASCII), every non-storage entry's CRC-32 checked (unless all
 * are 0), byteorder little, a version of 1..20, and a protocol-2 data.pkl
 * of the opcodes torch's tensor pickle uses, interpreted over plain values
 * with the allowed globals only (_rebuild_tensor_v2/_v3, OrderedDict,
 * UntypedStorage, the typed storages, the v3 dtypes), at most
 * SS_ZIP_MAX_PICKLE bytes, SS_ZIP_MAX_VALUES values and a stack of at most
 * 288. Strings are ASCII, integers fit in int64.
 *
 * Every offset and length read from the bytes is bounds-checked against the
 * buffer before use; nothing is read outside [buf, buf + len).
 * Thread-safe; no state; allocates only its value table (freed before
 * return).
 */
#ifndef SS_ZIPREAD_H
#define SS_ZIPREAD_H

#include <stddef.h>
#include <stdint.h>

#include "ss_error.h"

#define SS_ZIP_MAX_NDIM 64
#define SS_ZIP_MAX_ENTRIES 64
#define SS_ZIP_MAX_PICKLE ((size_t)64 << 10)
#define SS_ZIP_MAX_VALUES 4096

typedef struct ss_zip_tensor {
    const char *dtype; /* torch attribute name ("float32"); static */
    size_t itemsize;
    int ndim;
    int64_t shape[SS_ZIP_MAX_NDIM];
    int64_t stride[SS_ZIP_MAX_NDIM];
    int64_t storage_offset; /* elements */
    int64_t storage_numel;  /* elements */
    int requires_grad;
    uint64_t data_offset; /* of the storage bytes, in buf */
    uint64_t data_length;
    uint32_t data_crc32; /* as stored in the archive */
    int has_crc;   /* 0: torch wrote no CRC-32s (all 0): nothing to check */
    int conj, neg; /* torch's conj/neg view bits */
} ss_zip_tensor;

/* Recognise the record buf[0, len). 0 with *out filled; SS_EINVAL when it
 * is refused (detail in err, may be NULL); SS_ENOMEM. */
int ss_zipread_tensor(const void *buf, size_t len, ss_zip_tensor *out,
                      ss_errinfo *err);

#endif /* SS_ZIPREAD_H */
