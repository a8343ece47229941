/* ss_nccl.c - the libnccl table and its version check.
 * Thread safety: as ss_nccl.h (loading is serialised inside ss_dl). */
#include "ss_nccl.h"

#include "ss_error.h"

#include <stdio.h>
#include <string.h>

#ifdef SS_HAVE_NCCL_HEADERS
/* Compile-time proof that the header-less declarations match nccl.h; see
 * ss_cuda.c (_Generic does not evaluate &ncclX: nothing is linked). */
#define SS__CHECK_PROTO(ret, name, params)                                     \
    _Static_assert(_Generic(&name, ss_##name##_fn: 1, default: 0),             \
                   #name " does not match nccl.h's prototype");
SS_NCCL_SYMBOLS(SS__CHECK_PROTO)
#undef SS__CHECK_PROTO
#define SS__SAME_ABI(a, b)                                                     \
    _Static_assert(sizeof(a) == sizeof(b) && _Alignof(a) == _Alignof(b),       \
                   #a " and " #b " differ in size or alignment")
SS__SAME_ABI(ss__fb_ncclResult_t, ncclResult_t);
SS__SAME_ABI(ss__fb_ncclDataType_t, ncclDataType_t);
SS__SAME_ABI(ss__fb_ncclRedOp_t, ncclRedOp_t);
SS__SAME_ABI(ss__fb_ncclComm_t, ncclComm_t);
SS__SAME_ABI(ss__fb_ncclUniqueId, ncclUniqueId);
#undef SS__SAME_ABI
_Static_assert(sizeof(ncclUniqueId) == 128 &&
                   NCCL_UNIQUE_ID_BYTES == SS_NCCL_UNIQUE_ID_BYTES,
               "ncclUniqueId is not 128 bytes");
_Static_assert(_Generic((ss__fb_ncclComm_t)0, ncclComm_t: 1, default: 0),
               "ncclComm_t is not a pointer to struct ncclComm");
_Static_assert(SS_NCCL_SUCCESS == ncclSuccess &&
                   SS_NCCL_IN_PROGRESS == ncclInProgress,
               "ncclResult_t values differ");
_Static_assert(SS_NCCL_INT8 == ncclInt8 && SS_NCCL_UINT8 == ncclUint8 &&
                   SS_NCCL_INT32 == ncclInt32 && SS_NCCL_UINT32 == ncclUint32 &&
                   SS_NCCL_INT64 == ncclInt64 && SS_NCCL_UINT64 == ncclUint64 &&
                   SS_NCCL_FLOAT16 == ncclFloat16 &&
                   SS_NCCL_FLOAT32 == ncclFloat32 &&
                   SS_NCCL_FLOAT64 == ncclFloat64 &&
                   SS_NCCL_BFLOAT16 == ncclBfloat16 && SS_NCCL_SUM == ncclSum,
               "ncclDataType_t / ncclRedOp_t values differ");
#endif /* SS_HAVE_NCCL_HEADERS */

static const char *const default_names[] = {"libnccl.so.2", "libnccl.so"};

static const ss_dl_sym symbols[] = {
#define SS__SYM(ret, name, params) {#name, offsetof(ss_nccl, name)},
    SS_NCCL_SYMBOLS(SS__SYM)
#undef SS__SYM
};

int ss_nccl_version_code(int raw)
{
    if (raw <= 0)
        return 0;
    if (raw >= 10000)
        return raw;
    /* Before 2.9: 1000 * major + 100 * minor + patch. */
    return (raw / 1000) * 10000 + ((raw % 1000) / 100) * 100 + raw % 100;
}

static int check_version(void *table, char *why, size_t why_len)
{
    ss_nccl *nc = table;
    int raw = 0, v, rc;

    rc = nc->ncclGetVersion(&raw);
    if (rc != SS_NCCL_SUCCESS) {
        snprintf(why, why_len, "ncclGetVersion returned %d", rc);
        return SS_ENOTAVAIL;
    }
    v = ss_nccl_version_code(raw);
    if (v < SS_NCCL_MIN_VERSION) {
        snprintf(
            why, why_len, "NCCL %d.%d.%d is older than the minimum %d.%d.%d",
            v / 10000, (v % 10000) / 100, v % 100, SS_NCCL_MIN_VERSION / 10000,
            (SS_NCCL_MIN_VERSION % 10000) / 100, SS_NCCL_MIN_VERSION % 100);
        return SS_ENOTAVAIL;
    }
    nc->version = v;
    return 0;
}

static const ss_dl_spec spec = {
    .what = "libnccl",
    .defaults = default_names,
    .ndefaults = sizeof default_names / sizeof default_names[0],
    .syms = symbols,
    .nsyms = sizeof symbols / sizeof symbols[0],
    .table_size = sizeof(ss_nccl),
    .check = check_version,
};

int ss_nccl_load(const char *const *cands, size_t n, const ss_nccl **out,
                 char *reason, size_t reason_len)
{
    const void *t = NULL;
    int rc = ss_dl_load(&spec, cands, n, &t, reason, reason_len);

    *out = rc == 0 ? t : NULL;
    return rc;
}

int ss_nccl_probe(const char *const *cands, size_t n, ss_nccl_status *st)
{
    const ss_nccl *nc = NULL;
    int rc;

    memset(st, 0, sizeof *st);
    rc = ss_nccl_load(cands, n, &nc, st->reason, sizeof st->reason);
    if (rc < 0)
        return rc;
    st->loaded = 1;
    st->version = nc->version;
    snprintf(st->path, sizeof st->path, "%s", nc->lib.path);
    return 0;
}
