/* ss_flat.h - FSDP1 FlatParameter layout and flatten/unflatten copies.
 *
 * A layout is the flat parameter of one FSDP unit exactly as torch 2.13's
 * FlatParamHandle builds it (torch/distributed/fsdp/_flat_param.py):
 *
 *  - the unit's real (non-shared) parameters in order, numels[i] elements
 *    each (0 allowed);
 *  - align_numel > 0 (use_orig_params=True; torch uses 16 bytes / the
 *    parameter dtype's size): before each parameter, padding of
 *    align_numel - total % align_numel elements when that is in
 *    (0, align_numel); after the last one, padding of
 *    world_size - total % world_size when that is in (0, world_size);
 *  - align_numel == 0: no padding inside the flat parameter.
 *
 * flat_numel is the resulting total (torch's _unpadded_unsharded_size).
 * Sharding follows torch.chunk + F.pad: shard_numel = ceil(flat_numel /
 * world_size), padded_numel = shard_numel * world_size, and rank r owns
 * [r * shard_numel, (r + 1) * shard_numel) of the padded flat parameter
 * (a rank past the last chunk owns only padding). The per-parameter shard
 * infos are computed with torch's _get_shard_metadata formula, including
 * its treatment of zero-numel parameters (in the shard when strictly
 * inside it, with numel_in_shard 0 and intra_param_end_idx -1).
 *
 * The copies move bytes between per-parameter buffers and ranks' flat
 * shards for many jobs at once, split over an ss_pool: flatten writes a
 * whole shard (parameters, zeros for a missing one, and the padding
 * element everywhere else); unflatten scatters a shard's parameter ranges
 * into whichever per-parameter buffers are given. Every length, offset and
 * product is overflow-checked, and destination ranges may not overlap each
 * other or any source range (SS_EOVERLAP).
 *
 * Thread safety: a layout is immutable after ss_flat_layout_new, so any
 * number of threads may use it at once. The copies touch only the memory
 * their jobs name.
 */
#ifndef SS_FLAT_H
#define SS_FLAT_H

#include <stddef.h>
#include <stdint.h>

#include "ss_error.h"
#include "ss_pool.h"

typedef struct ss_flat_layout ss_flat_layout;

/* Build the layout of nparams (>= 1) parameters. world_size >= 1,
 * align_numel >= 0, every numel >= 0. 0, SS_EINVAL (detail in err),
 * SS_ERANGE (a total overflows int64) or SS_ENOMEM. err may be NULL. */
int ss_flat_layout_new(ss_flat_layout **out, size_t nparams,
                       const int64_t *numels, int64_t world_size,
                       int64_t align_numel, ss_errinfo *err);

/* NULL is a no-op. */
void ss_flat_layout_free(ss_flat_layout *l);

size_t ss_flat_nparams(const ss_flat_layout *l);
int64_t ss_flat_world_size(const ss_flat_layout *l);
int64_t ss_flat_align_numel(const ss_flat_layout *l);
/* Per real parameter (nparams entries). */
const int64_t *ss_flat_numels(const ss_flat_layout *l);
const int64_t *ss_flat_offsets(const ss_flat_layout *l);
/* End of the last parameter. */
int64_t ss_flat_unpadded_numel(const ss_flat_layout *l);
/* Parameters plus alignment and world-size padding (before chunk padding). */
int64_t ss_flat_flat_numel(const ss_flat_layout *l);
int64_t ss_flat_shard_numel(const ss_flat_layout *l);
int64_t ss_flat_padded_numel(const ss_flat_layout *l);
/* torch's _numels_with_padding / _is_padding_mask: parameters and padding
 * tensors in flat order (nsegments entries). */
size_t ss_flat_nsegments(const ss_flat_layout *l);
const int64_t *ss_flat_segment_numels(const ss_flat_layout *l);
const unsigned char *ss_flat_segment_is_padding(const ss_flat_layout *l);

/* torch's _ShardParamInfo. When in_shard is 0 the other fields are 0 and
 * mean None. intra_end is inclusive, as torch's. */
typedef struct ss_flat_info {
    int in_shard;
    int64_t offset_in_shard;
    int64_t numel_in_shard;
    int64_t intra_start;
    int64_t intra_end;
} ss_flat_info;

/* rank's [start, end) in the padded flat parameter. 0 or SS_EINVAL. */
int ss_flat_shard_range(const ss_flat_layout *l, int64_t rank, int64_t *start,
                        int64_t *end, ss_errinfo *err);

/* Shard infos (nparams entries into out) of the range [start, end) of the
 * padded flat parameter, 0 <= start <= end (end may pass padded_numel, as
 * torch allows): torch's _get_shard_metadata(start, end - 1). 0 or
 * SS_EINVAL. */
int ss_flat_range_infos(const ss_flat_layout *l, int64_t start, int64_t end,
                        ss_flat_info *out, ss_errinfo *err);

/* ss_flat_range_infos of rank's shard range. */
int ss_flat_shard_infos(const ss_flat_layout *l, int64_t rank,
                        ss_flat_info *out, ss_errinfo *err);

/* One parameter's buffer: elements [start, start + numel) of the
 * parameter's flattened data (a full parameter has start 0 and numel =
 * its numel; an FSDP2-style dim-0 shard is a sub-range). data NULL: no
 * buffer (flatten writes zeros for the parameter, unflatten skips it). */
typedef struct ss_flat_piece {
    void *data;
    int64_t start;
    int64_t numel;
} ss_flat_piece;

/* One unit, one rank, one state. shard holds shard_numel elements of
 * itemsize bytes; pieces has nparams entries. pad is the padding element
 * (itemsize bytes) flatten writes into padding, NULL for zeros; unflatten
 * ignores it. */
typedef struct ss_flat_job {
    const ss_flat_layout *layout;
    int64_t rank;
    size_t itemsize;
    void *shard;
    const ss_flat_piece *pieces;
    const void *pad;
} ss_flat_job;

/* Largest itemsize accepted. */
#define SS_FLAT_MAX_ITEMSIZE 64

/* flatten: write every job's whole shard from its pieces. A piece with
 * data must hold the whole part of its parameter that falls in the shard
 * (else SS_ERANGE). unflatten: copy each job's shard into its pieces, each
 * piece receiving the part of the shard's parameter range it holds.
 * Errors (nothing is copied then): SS_EINVAL for a bad job (err->job names
 * it, detail names the parameter), SS_ERANGE for a size that overflows or
 * a piece outside its parameter, SS_EOVERLAP when a destination range
 * overlaps another destination or a source, SS_ENOMEM. */
int ss_flat_flatten(ss_pool *pool, const ss_flat_job *jobs, size_t njobs,
                    ss_errinfo *err);
int ss_flat_unflatten(ss_pool *pool, const ss_flat_job *jobs, size_t njobs,
                      ss_errinfo *err);

/* Bytes per pool task (copies are grouped or split to about this). */
#define SS_FLAT_TASK_BYTES ((size_t)1 << 20)

#endif /* SS_FLAT_H */
