/* ss_stheader.h - strict parse of a safetensors file's header.
 *
 * A safetensors file is an 8-byte little-endian header length n, n bytes of
 * a JSON object, then the data. The object maps tensor names to
 * {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the
 * data) and may hold "__metadata__", a string -> string map (or null).
 *
 * What is accepted is what the `safetensors` package (0.8) accepts, which is
 * what torch 2.13's readers use (safe_open), except where the format's
 * specification is stricter than the package (the parser follows the
 * specification there):
 *  - JSON as RFC 8259 (serde_json's): no trailing commas, no leading zeros,
 *    control characters refused in strings, escapes resolved, \u escapes
 *    paired into valid code points, raw bytes valid UTF-8; whitespace may
 *    follow the object (the header's padding), nothing else;
 *  - the header begins with '{' (the spec's MUST; the package lets leading
 *    whitespace through); no key appears twice in the header, in
 *    __metadata__ or in an entry (the spec's "duplicate keys are
 *    disallowed"; the package keeps the last);
 *  - an entry holds exactly dtype, shape and data_offsets (the package
 *    ignores other keys: kept refused, as shardstate always did);
 *  - dtype one of the names ss_st_dtype_name() knows; shape dims and
 *    offsets are JSON integers (no fraction, exponent or sign) below 2^62
 *    (dims) or 2^63 (offsets); at most SS_ST_NDIM_MAX dims; the element
 *    count times the item size does not overflow; end - begin is that
 *    byte count; end lies inside the data;
 *  - sorted by (begin, end), the tensors tile the data exactly: each begins
 *    where the previous ended (no overlap, no hole) and the last ends at the
 *    data's end (no trailing bytes), as the package checks.
 * Nesting is bounded (SS_ST_DEPTH_MAX) and so is the header
 * (SS_ST_HEADER_MAX, safetensors' own limit); no input makes the parser read
 * outside [head, head + len) or recurse deeper than the bound.
 *
 * Errors: SS_EINVAL (malformed), SS_ERANGE (a length or offset outside the
 * file), SS_ENOMEM; err->detail says what and names the tensor, as
 * "tensor 'name': ...". Thread-safe; no state; the result is immutable and
 * owned by the caller (ss_st_free).
 */
#ifndef SS_STHEADER_H
#define SS_STHEADER_H

#include <stddef.h>
#include <stdint.h>

#include "ss_error.h"

#define SS_ST_HEADER_MAX 100000000u
#define SS_ST_NDIM_MAX 64
#define SS_ST_DEPTH_MAX 64

typedef struct ss_st_tensor {
    size_t name_off, name_len; /* in strings: the decoded UTF-8 name */
    int dtype;                 /* for ss_st_dtype_name / _size */
    int ndim;
    size_t shape_off;    /* in dims */
    uint64_t begin, end; /* [begin, end) relative to the data start */
} ss_st_tensor;

typedef struct ss_st_header {
    const char *strings; /* decoded names, keys and values, back to back */
    const int64_t *dims;
    size_t ntensors;
    const ss_st_tensor *tensors; /* in the header's order */
    int has_metadata;            /* 0: absent or null */
    size_t nmeta;
    const size_t *meta; /* nmeta x (key_off, key_len, value_off, value_len) */
} ss_st_header;

/* The header length from the file's first 8 bytes, checked against the
 * limit and the file size. 0 with *head_len set, or SS_ERANGE. */
int ss_st_prefix(const uint8_t prefix[8], uint64_t file_size,
                 uint64_t *head_len, ss_errinfo *err);

/* data_len when the file's size is not known (a header read from a
 * stream): every check but the last tensor ending at the data's end. */
#define SS_ST_ANY_LEN UINT64_MAX

/* Parse and check head[0, len) (the JSON after the length prefix) for a
 * data area of data_len bytes (or SS_ST_ANY_LEN). 0 with *out set, or a
 * negative code with *out NULL. */
int ss_st_parse(const uint8_t *head, size_t len, uint64_t data_len,
                ss_st_header **out, ss_errinfo *err);

void ss_st_free(ss_st_header *h);

/* The safetensors name and item size of a dtype index; NULL / 0 outside
 * 0 .. ss_st_ndtypes() - 1. */
const char *ss_st_dtype_name(int dtype);
size_t ss_st_dtype_size(int dtype);
int ss_st_ndtypes(void);

#endif /* SS_STHEADER_H */
