/* ss_error.c - the error table and ss_errinfo helpers.
 * Thread safety: functions touch only the ss_errinfo they are given. */
#include "ss_error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

void ss_errinfo_clear(ss_errinfo *e)
{
    if (e == NULL)
        return;
    e->code = 0;
    e->sys_errno = 0;
    e->op = NULL;
    e->offset = -1;
    e->job = -1;
    e->path[0] = '\0';
    e->detail[0] = '\0';
}

int ss_errinfo_set(ss_errinfo *e, int code, const char *op, const char *path,
                   int64_t offset, const char *fmt, ...)
{
    if (e == NULL)
        return code;
    e->code = code;
    e->sys_errno = ss_is_errno(code) ? -code : 0;
    e->op = op;
    e->offset = offset;
    e->job = -1; /* a batch sets the job after */
    e->path[0] = '\0';
    if (path != NULL)
        snprintf(e->path, sizeof e->path, "%s", path);
    e->detail[0] = '\0';
    if (fmt != NULL) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->detail, sizeof e->detail, fmt, ap);
        va_end(ap);
    }
    return code;
}

void ss_errinfo_copy(ss_errinfo *dst, const ss_errinfo *src)
{
    memcpy(dst, src, sizeof *dst);
}

const char *ss_strerror(int code)
{
    switch (code) {
#define SS__CASE(name, value, msg)                                             \
    case name:                                                                 \
        return msg;
        SS_ERROR_TABLE(SS__CASE)
#undef SS__CASE
    default:
        return NULL;
    }
}
