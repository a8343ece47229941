/* ss_geom.h - chunk geometry: boxes in N dimensions and copies between them.
 *
 * A box is an (offsets, sizes) pair of ndim int64 each, in global element
 * coordinates: it holds the points p with offsets[d] <= p[d] <
 * offsets[d] + sizes[d]. Valid boxes have offsets >= 0, sizes >= 0 and
 * offsets[d] + sizes[d] <= INT64_MAX. A box with some size 0 is empty and
 * overlaps nothing. ndim == 0 is a scalar: the one point, which every
 * 0-d box holds, so every saved box overlaps every request.
 *
 * ss_geom_index: built once from n saved boxes (a tensor's saved chunks),
 * then queried with requested boxes (a rank's shard). It is a bounding-box
 * tree over the non-empty boxes, split at the median of the dimension of
 * largest spread, so a query on a tiling costs about O(log n + k) for k
 * overlaps. Results are in ascending saved index order; identical saved
 * boxes (replicas) are all returned and the caller picks.
 *
 * ss_copy_nd: copy a sizes-shaped region of elements between two strided
 * buffers (byte strides, any sign, any element size), split over a thread
 * pool when large.
 *
 * Thread safety: an index is immutable after ss_geom_index_new, so any
 * number of threads may query it at once, each with its own ss_overlaps.
 * ss_copy_nd touches only the memory it is given.
 */
#ifndef SS_GEOM_H
#define SS_GEOM_H

#include <stddef.h>
#include <stdint.h>

#include "ss_error.h"
#include "ss_pool.h"

/* Most dimensions a box or a copy may have (NumPy's limit). */
#define SS_GEOM_MAX_NDIM 64

typedef struct ss_geom_index ss_geom_index;

/* Build an index over n boxes; offsets and sizes are row-major n x ndim.
 * The arrays are copied. 0, SS_EINVAL (bad ndim or box, detail in err),
 * or SS_ENOMEM. err may be NULL. */
int ss_geom_index_new(ss_geom_index **out, int ndim, size_t n,
                      const int64_t *offsets, const int64_t *sizes,
                      ss_errinfo *err);

/* NULL is a no-op. */
void ss_geom_index_free(ss_geom_index *ix);

size_t ss_geom_index_count(const ss_geom_index *ix);
int ss_geom_index_ndim(const ss_geom_index *ix);

/* Query results, a growable struct of arrays the caller owns:
 * init it once, pass it to any number of queries (each one overwrites it),
 * destroy it at the end. Row i of the result is overlap i:
 *   request_index[i]       which request (always 0 for ss_geom_query)
 *   saved_index[i]         which saved box
 *   saved_offset[i*ndim+d] where the overlap starts, relative to that box
 *   request_offset[i*ndim+d] where it starts, relative to the request
 *   lengths[i*ndim+d]      its extent (all > 0 when ndim > 0)
 * Rows are sorted by (request_index, saved_index). visited counts the tree
 * nodes plus the boxes tested by the last query: a measure of its cost. */
typedef struct ss_overlaps {
    size_t count;
    size_t cap; /* rows allocated */
    int ndim;
    int64_t *request_index;
    int64_t *saved_index;
    int64_t *saved_offset;
    int64_t *request_offset;
    int64_t *lengths;
    uint64_t visited;
} ss_overlaps;

void ss_overlaps_init(ss_overlaps *o);
void ss_overlaps_destroy(ss_overlaps *o);

/* Every saved box that overlaps the request box (ndim values each).
 * 0, SS_EINVAL (invalid request) or SS_ENOMEM. On error out->count is 0. */
int ss_geom_query(const ss_geom_index *ix, const int64_t *offsets,
                  const int64_t *sizes, ss_overlaps *out, ss_errinfo *err);

/* The same for m requests (row-major m x ndim); rows are tagged with their
 * request's index. On an invalid request, err->job names it. */
int ss_geom_query_many(const ss_geom_index *ix, size_t m,
                       const int64_t *offsets, const int64_t *sizes,
                       ss_overlaps *out, ss_errinfo *err);

/* Copy the region of sizes[0] x ... x sizes[ndim-1] elements of elsize
 * bytes each: element (i0, ..., in) goes from src + sum(i_d*src_strides[d])
 * to dst + sum(i_d*dst_strides[d]). Strides are in bytes and may be
 * negative or unaligned (elements are moved with memcpy); src strides may
 * be 0 (broadcast). Adjacent dimensions contiguous in both are merged,
 * contiguous rows are copied with memcpy, transposing copies are done in
 * cache-sized tiles, and copies over 1 MiB are split over pool's threads
 * (pool may be NULL).
 *
 * Errors: SS_EINVAL for ndim outside [0, SS_GEOM_MAX_NDIM], a negative size,
 * elsize 0, a NULL buffer with a non-empty region, or a dst stride of 0
 * over a dimension of size > 1 (dst would overlap itself); SS_ERANGE when
 * the byte extent of a region overflows int64; SS_EOVERLAP when the byte
 * ranges spanned by src and dst intersect (checked on extents, so some
 * disjoint interleaved views are refused too); copying a region onto
 * itself (same pointer and strides) is a no-op. Other self-overlapping dst
 * layouts (e.g. from as_strided) are not detected: the result is then
 * unspecified, but nothing is read or written outside the two regions. */
int ss_copy_nd(ss_pool *pool, void *dst, const int64_t *dst_strides,
               const void *src, const int64_t *src_strides,
               const int64_t *sizes, int ndim, size_t elsize, ss_errinfo *err);

/* Bytes above which ss_copy_nd uses the pool. */
#define SS_COPY_PARALLEL_MIN ((int64_t)1 << 20)

#endif /* SS_GEOM_H */
