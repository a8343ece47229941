/* ss_file.c - single-file operations through the OS vtable (see ss_file.h).
 *
 * Each function opens what it needs, does its work with the transfer loops
 * of ss_io.c and closes on every path. Calls that may report EINTR are
 * retried by RETRY, except close (on Linux the descriptor is gone after
 * any close).
 */
#include "ss_file.h"
#include "ss_io.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* rc = expr, repeated while it reports EINTR. */
#define RETRY(rc, expr)                                                        \
    do                                                                         \
        (rc) = (expr);                                                         \
    while ((rc) == -EINTR)

/* Open path for reading without blocking on a FIFO and check that it is a
 * regular file: the descriptor (>= 0) and its size, or a negative code. */
static int open_regular(const ss_os *os, const char *path, int64_t *size,
                        ss_errinfo *err)
{
    int fd, rc;
    RETRY(fd, os->open(os, path, O_RDONLY | O_CLOEXEC | O_NONBLOCK, 0));
    if (fd < 0)
        return ss_errinfo_set(err, fd, "open", path, -1, NULL);
    RETRY(rc, os->fsize(os, fd, size));
    if (rc < 0) {
        os->close(os, fd);
        return ss_errinfo_set(err, rc, "fstat", path, -1, NULL);
    }
    return fd;
}

/* Close fd; a failure (other than EINTR, after which it is closed too) is
 * recorded unless rc already holds one. */
static int close_fd(const ss_os *os, int fd, int rc, const char *path,
                    ss_errinfo *err)
{
    int c = os->close(os, fd);
    if (rc == 0 && c < 0 && c != -EINTR)
        return ss_errinfo_set(err, c, "close", path, -1, NULL);
    return rc;
}

int ss_file_publish(const ss_os *os, const char *path, const void *data,
                    size_t len, int durable, ss_errinfo *err)
{
    size_t plen = strlen(path);
    const char *slash = strrchr(path, '/');
    char *dir = malloc(plen + 2), *tmp = malloc(plen + 80);
    int rc = 0, fd = -1, created = 0;
    int64_t at = -1;
    const char *op = NULL;
    struct timespec ts;

    if (os == NULL)
        os = ss_os_default();
    if (dir == NULL || tmp == NULL) {
        rc = ss_errinfo_set(err, SS_ENOMEM, "malloc", path, -1, NULL);
        goto out;
    }
    if (slash == NULL) {
        strcpy(dir, ".");
    } else {
        size_t n = slash == path ? 1 : (size_t)(slash - path);
        memcpy(dir, path, n);
        dir[n] = '\0';
    }
    /* "<dir>/.<name>.<pid>.<ns>.<try>.tmp"; O_EXCL makes it unique. */
    clock_gettime(CLOCK_REALTIME, &ts);
    for (int attempt = 0;; attempt++) {
        snprintf(tmp, plen + 80, "%.*s.%s.%ld.%lld.%d.tmp",
                 (int)(slash ? slash - path + 1 : 0), path,
                 slash ? slash + 1 : path, (long)getpid(),
                 (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec, attempt);
        RETRY(fd,
              os->open(os, tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666));
        if (fd != -EEXIST || attempt == 100)
            break;
    }
    if (fd < 0) {
        rc = fd;
        fd = -1;
        op = "open";
        goto out;
    }
    created = 1;
    if ((rc = ss_io_write_all(os, fd, data, len, 0, &at)) < 0) {
        op = "pwrite";
        goto out;
    }
    if (durable)
        RETRY(rc, os->fsync(os, fd));
    if (rc < 0) {
        op = "fsync";
        goto out;
    }
    rc = os->close(os, fd);
    fd = -1;
    if (rc < 0 && rc != -EINTR) {
        op = "close";
        goto out;
    }
    RETRY(rc, os->rename(os, tmp, path));
    if (rc < 0) {
        op = "rename";
        goto out;
    }
    created = 0;
    rc = 0;
    if (durable)
        RETRY(rc, os->fsync_dir(os, dir));
    if (rc < 0) {
        op = "fsync_dir";
        goto out;
    }
out:
    if (op != NULL)
        ss_errinfo_set(err, rc, op, path, at, "%s '%s'",
                       strcmp(op, "fsync_dir") ? "temp file" : "directory",
                       strcmp(op, "fsync_dir") ? tmp : dir);
    if (fd >= 0)
        os->close(os, fd);
    if (created)
        os->unlink(os, tmp);
    free(dir);
    free(tmp);
    return rc;
}

/* ---- reading ------------------------------------------------------------ */

int ss_file_read(const ss_os *os, const char *path, uint64_t max, void **out,
                 uint64_t *len, ss_errinfo *err)
{
    int64_t size = 0, at = -1;
    char probe;
    void *buf = NULL;
    int fd, rc = 0;

    *out = NULL;
    *len = 0;
    if (os == NULL)
        os = ss_os_default();
    if ((fd = open_regular(os, path, &size, err)) < 0)
        return fd;
    if (size <= 0 || (uint64_t)size > max) {
        rc = ss_errinfo_set(err, SS_ERANGE, "fstat", path, -1,
                            "the file has %lld bytes, expected 1..%llu",
                            (long long)size, (unsigned long long)max);
        goto out;
    }
    if ((buf = malloc((size_t)size)) == NULL) {
        rc = ss_errinfo_set(err, SS_ENOMEM, "malloc", path, -1, NULL);
        goto out;
    }
    if ((rc = ss_io_read_all(os, fd, buf, (uint64_t)size, 0, &at)) < 0) {
        ss_errinfo_set(err, rc, "pread", path, at,
                       rc == SS_ESHORT ? "the file shrank while being read"
                                       : NULL);
        goto out;
    }
    /* one byte more: a file that grew while read is not taken whole */
    rc = ss_io_read_all(os, fd, &probe, 1, size, &at);
    if (rc == 0)
        rc = ss_errinfo_set(err, SS_ESHORT, "pread", path, size,
                            "the file grew while being read");
    else if (rc == SS_ESHORT)
        rc = 0;
    else
        ss_errinfo_set(err, rc, "pread", path, at, NULL);
out:
    rc = close_fd(os, fd, rc, path, err);
    if (rc < 0) {
        free(buf);
        return rc;
    }
    *out = buf;
    *len = (uint64_t)size;
    return 0;
}

int ss_file_size(const ss_os *os, const char *path, int64_t *size,
                 ss_errinfo *err)
{
    int fd;
    if (os == NULL)
        os = ss_os_default();
    if ((fd = open_regular(os, path, size, err)) < 0)
        return fd;
    return close_fd(os, fd, 0, path, err);
}

int ss_file_map(const ss_os *os, const char *path, void **addr, int64_t *size,
                ss_errinfo *err)
{
    int fd, rc = 0;

    *addr = NULL;
    *size = 0;
    if (os == NULL)
        os = ss_os_default();
    if ((fd = open_regular(os, path, size, err)) < 0)
        return fd;
    if (*size > 0 && (uint64_t)*size > SIZE_MAX)
        rc = ss_errinfo_set(err, SS_ERANGE, "mmap", path, -1,
                            "the file is larger than the address space");
    else if (*size > 0) {
        RETRY(rc, os->mmap(os, fd, (size_t)*size, addr));
        if (rc < 0)
            ss_errinfo_set(err, rc, "mmap", path, -1, NULL);
    }
    rc = close_fd(os, fd, rc, path, err); /* the mapping outlives it */
    if (rc < 0 && *addr != NULL) {
        os->munmap(os, *addr, (size_t)*size);
        *addr = NULL;
    }
    return rc;
}

void ss_file_unmap(const ss_os *os, void *addr, int64_t size)
{
    if (os == NULL)
        os = ss_os_default();
    if (addr != NULL && size > 0)
        os->munmap(os, addr, (size_t)size);
}

/* ---- directory entries -------------------------------------------------- */

int ss_file_unlink(const ss_os *os, const char *path, int missing_ok,
                   ss_errinfo *err)
{
    int rc;
    if (os == NULL)
        os = ss_os_default();
    RETRY(rc, os->unlink(os, path));
    if (rc == -ENOENT && missing_ok)
        return 0;
    if (rc < 0)
        return ss_errinfo_set(err, rc, "unlink", path, -1, NULL);
    return 1;
}

int ss_file_fsync_dir(const ss_os *os, const char *dir, ss_errinfo *err)
{
    int rc;
    if (os == NULL)
        os = ss_os_default();
    RETRY(rc, os->fsync_dir(os, dir));
    return rc < 0 ? ss_errinfo_set(err, rc, "fsync_dir", dir, -1, NULL) : 0;
}

/* After mkdir reported EEXIST: 0 when path is a directory, -EEXIST when
 * it is something else, or the error that kept it from being looked at. */
static int existing_dir(const ss_os *os, const char *path)
{
    int fd;
    RETRY(fd, os->open(os, path, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0));
    if (fd == -ENOTDIR)
        return -EEXIST;
    if (fd < 0)
        return fd;
    os->close(os, fd);
    return 0;
}

int ss_file_mkdirs(const ss_os *os, const char *path, ss_errinfo *err)
{
    size_t n = strlen(path);
    char *p;
    int rc;

    if (os == NULL)
        os = ss_os_default();
    /* the common cases first: the parent exists, or path itself does */
    RETRY(rc, os->mkdir(os, path));
    if (rc == 0)
        return 0;
    if (rc == -EEXIST && (rc = existing_dir(os, path)) == 0)
        return 0;
    if (rc == -EEXIST)
        return ss_errinfo_set(err, rc, "mkdir", path, -1,
                              "it exists and is not a directory");
    if (rc != -ENOENT)
        return ss_errinfo_set(err, rc, "mkdir", path, -1, NULL);
    if ((p = malloc(n + 1)) == NULL)
        return ss_errinfo_set(err, SS_ENOMEM, "malloc", path, -1, NULL);
    memcpy(p, path, n + 1);
    /* every prefix ending before a '/', then path itself */
    for (size_t i = 1; i <= n; i++) {
        if (i < n && p[i] != '/')
            continue;
        p[i] = '\0';
        RETRY(rc, os->mkdir(os, p));
        if (rc == -EEXIST)
            rc = existing_dir(os, p);
        if (i < n)
            p[i] = '/';
        if (rc < 0) {
            ss_errinfo_set(err, rc, "mkdir", path, -1, "creating '%.*s'",
                           (int)i, path);
            break;
        }
    }
    free(p);
    return rc < 0 ? rc : 0;
}
