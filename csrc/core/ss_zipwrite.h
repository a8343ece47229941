/* ss_zipwrite.h - the torch.save zip framing of one tensor record.
 *
 * Every tensor item of a DCP data file is one complete torch.save archive
 * (docs/FORMAT.md, section 3): a header (data.pkl, .format_version,
 * .storage_alignment, byteorder and data/0's local header, padded so the
 * storage bytes start at a multiple of 64), the storage bytes, and a
 * trailer (data/0's descriptor, version, .data/serialization_id, the
 * central directory and the zip64 end records). A plan holds the header
 * and the trailer for data CRC 0 (the template); only the trailer depends
 * on the data, through its CRC-32, in five places: data/0's descriptor and
 * directory CRC, the serialization id's CRC hash (c10::hash_combine of the
 * records' CRCs, 20 decimal digits), and that entry's descriptor and
 * directory CRC. ss_zip_plan_patch rewrites those five in a copy of the
 * template (no allocation, a CRC of 40 bytes): the writer's per-record
 * cost.
 *
 * The bytes are torch 2.13's for a CPU tensor with storage offset 0 saved
 * to a file object (folder "archive"), byte for byte what
 * python/shardstate/checkpoint/_zipfmt.py plan_tensor_record produces
 * (tests/test_zipwrite.py compares them). An empty storage (0 bytes) has
 * no descriptor and no CRC in the id: its trailer does not depend on the
 * CRC and patching it is a no-op.
 *
 * Errors: ss_zip_plan_new returns 0 or SS_EINVAL (unknown dtype, negative
 * or mismatched geometry, a storage too small for the strides) or
 * SS_ENOMEM. A plan is immutable once made: any number of threads may
 * read and patch from it at once.
 */
#ifndef SS_ZIPWRITE_H
#define SS_ZIPWRITE_H

#include <stddef.h>
#include <stdint.h>

#include "ss_error.h"

/* Most dimensions a plan takes (the reader's bound too). */
#define SS_ZIP_MAX_NDIM 64

typedef struct ss_zip_plan ss_zip_plan;

/* The plan of the record torch.save writes for a tensor of dtype (torch's
 * name, with or without "torch.": "float32", "torch.bfloat16"), shape and
 * stride (ndim entries each; stride NULL = contiguous) over a storage of
 * storage_numel elements (< 0: the span the strides reach). */
int ss_zip_plan_new(const char *dtype, size_t ndim, const int64_t *shape,
                    const int64_t *stride, int64_t storage_numel,
                    ss_zip_plan **out);
void ss_zip_plan_free(ss_zip_plan *plan);

/* The header: everything before the storage bytes (a multiple of 64). */
const uint8_t *ss_zip_plan_header(const ss_zip_plan *plan, size_t *len);
/* The storage bytes' length. */
uint64_t ss_zip_plan_data_length(const ss_zip_plan *plan);
/* The trailer for data CRC 0. */
const uint8_t *ss_zip_plan_trailer(const ss_zip_plan *plan, size_t *len);
/* header + data + trailer. */
uint64_t ss_zip_plan_total_length(const ss_zip_plan *plan);

/* trailer holds a copy of the template (or a trailer of this plan for
 * any CRC): make it the trailer for data CRC crc. */
void ss_zip_plan_patch(const ss_zip_plan *plan, uint8_t *trailer, uint32_t crc);

/* libstdc++'s std::hash<std::string> on 64-bit and c10::hash_combine
 * (the serialization id's parts; exposed for tests). */
uint64_t ss_zip_std_hash(const void *data, size_t len);
uint64_t ss_zip_hash_combine(uint64_t seed, uint64_t v);

#endif /* SS_ZIPWRITE_H */
