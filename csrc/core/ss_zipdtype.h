/* ss_zipdtype.h - the tensor dtypes of a torch.save record.
 *
 * One table for the record framing (ss_zipwrite) and its recognition
 * (ss_zipread): each dtype's name (torch's, without "torch."), element size
 * and, for the dtypes torch.save still writes through a legacy typed
 * storage class (torch._utils._rebuild_tensor_v2), that class's name; the
 * others are written with torch._utils._rebuild_tensor_v3 and the dtype.
 * Read-only; thread-safe. */
#ifndef SS_ZIPDTYPE_H
#define SS_ZIPDTYPE_H

typedef struct ss_zip_dtype {
    const char *name;
    int itemsize;
    const char *storage; /* legacy typed storage class, or NULL: v3 */
} ss_zip_dtype;

extern const ss_zip_dtype ss_zip_dtypes[];
extern const int ss_zip_ndtypes;

/* The entry named name, or NULL. */
const ss_zip_dtype *ss_zip_dtype_find(const char *name);

#endif /* SS_ZIPDTYPE_H */
