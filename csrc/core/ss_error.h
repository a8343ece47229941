/* ss_error.h - error codes and the per-handle "last error" record.
 *
 * Every core function that can fail returns int: 0, or a negative code.
 * System failures are -errno (always < 1000 in magnitude); the core's own
 * codes come from one X-macro table below and live at -1000 and beyond, so
 * the two ranges never collide.
 *
 * An ss_errinfo carries the detail of one failure (operation, path, offset,
 * job index, errno). It is filled by the function that saw the failure and
 * read by the caller; it is not shared between threads (workers fill their
 * own and the batch keeps the first).
 */
#ifndef SS_ERROR_H
#define SS_ERROR_H

#include <stdint.h>

/* X(name, value, message) */
#define SS_ERROR_TABLE(X)                                                      \
    X(SS_EINVAL, -1001, "invalid argument")                                    \
    X(SS_ENOMEM, -1002, "out of memory")                                       \
    X(SS_ECHECKSUM, -1003, "checksum mismatch")                                \
    X(SS_ERANGE, -1004, "offset or length outside the file or buffer")         \
    X(SS_EOVERLAP, -1005, "regions overlap or do not fit")                     \
    X(SS_ECANCELED, -1006, "canceled after another job failed")                \
    X(SS_ENOTAVAIL, -1007, "feature or library not available")                 \
    X(SS_EINTERNAL, -1008, "internal error")                                   \
    X(SS_ESHORT, -1009, "unexpected end of file")                              \
    X(SS_EDEVICE, -1010, "a device (CUDA) runtime call failed")                \
    X(SS_ENOTREG, -1011, "not a regular file")

enum {
#define SS__ENUM(name, value, msg) name = value,
    SS_ERROR_TABLE(SS__ENUM)
#undef SS__ENUM
        SS_OK = 0
};

#define SS_ERR_PATH_MAX 512
#define SS_ERR_DETAIL_MAX 256

typedef struct ss_errinfo {
    int code;       /* 0 or the negative code returned */
    int sys_errno;  /* errno behind code, or 0 */
    const char *op; /* static string naming the operation, or NULL */
    int64_t offset; /* file or buffer offset involved, or -1 */
    int64_t job;    /* index of the failing job in a batch, or -1 */
    char path[SS_ERR_PATH_MAX];     /* file involved, or "" */
    char detail[SS_ERR_DETAIL_MAX]; /* free text, or "" */
} ss_errinfo;

/* Reset to "no error". */
void ss_errinfo_clear(ss_errinfo *e);

/* Record a failure and return code, so callers can write
 *   return ss_errinfo_set(e, -errno, "open", path, -1, NULL);
 * e may be NULL (the detail is dropped). code < 0; a code in -1..-999 is
 * taken as -errno and stored in sys_errno too. fmt may be NULL. job is
 * reset to -1 (set it after, for a batch). */
int ss_errinfo_set(ss_errinfo *e, int code, const char *op, const char *path,
                   int64_t offset, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 6, 7)))
#endif
    ;

/* Copy src into dst (both non-NULL). */
void ss_errinfo_copy(ss_errinfo *dst, const ss_errinfo *src);

/* Static message for one of the core's own codes; NULL for -errno codes
 * (the caller formats those with strerror) and for unknown codes. */
const char *ss_strerror(int code);

/* 1 when code is a -errno value rather than one of the core's codes. */
static inline int ss_is_errno(int code)
{
    return code < 0 && code > -1000;
}

#endif /* SS_ERROR_H */
