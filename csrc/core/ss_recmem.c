/* ss_recmem.c - the ss_os over caller buffers (see ss_recmem.h). */
#include "ss_recmem.h"

#include <errno.h>
#include <string.h>

static const ss_memfile *file_of(const ss_os *os, int fd)
{
    const ss_memos *m = (const ss_memos *)os->ctx;
    return fd >= 0 && (size_t)fd < m->n ? &m->files[fd] : NULL;
}

static int mem_open(const ss_os *os, const char *path, int flags, int mode)
{
    const ss_memos *m = (const ss_memos *)os->ctx;
    uint64_t k = 0;
    const char *p;

    (void)flags;
    (void)mode;
    if (path == NULL || strncmp(path, "mem:", 4) != 0 || path[4] == '\0' ||
        (path[4] == '0' && path[5] != '\0')) /* no leading zeros */
        return -ENOENT;
    for (p = path + 4; *p != '\0'; p++) {
        if (*p < '0' || *p > '9' || k > (uint64_t)m->n)
            return -ENOENT;
        k = k * 10 + (uint64_t)(*p - '0');
    }
    if (k >= m->n || k > INT32_MAX)
        return -ENOENT;
    return (int)k;
}

static int mem_close(const ss_os *os, int fd)
{
    return file_of(os, fd) != NULL ? 0 : -EBADF;
}

/* [off, off + n) inside f, or -errno. */
static int span(const ss_memfile *f, size_t n, int64_t off)
{
    if (f == NULL)
        return -EBADF;
    if (off < 0)
        return -EINVAL;
    if ((uint64_t)off > f->size || n > f->size - (uint64_t)off)
        return -EFBIG;
    return 0;
}

static int64_t mem_pwrite(const ss_os *os, int fd, const void *buf, size_t n,
                          int64_t off)
{
    const ss_memfile *f = file_of(os, fd);
    int rc = span(f, n, off);
    if (rc < 0)
        return rc;
    if (n > 0)
        memcpy(f->base + off, buf, n);
    return (int64_t)n;
}

static int64_t mem_pread(const ss_os *os, int fd, void *buf, size_t n,
                         int64_t off)
{
    const ss_memfile *f = file_of(os, fd);
    if (f == NULL)
        return -EBADF;
    if (off < 0)
        return -EINVAL;
    if ((uint64_t)off >= f->size)
        return 0;
    if (n > f->size - (uint64_t)off)
        n = (size_t)(f->size - (uint64_t)off);
    if (n > 0)
        memcpy(buf, f->base + off, n);
    return (int64_t)n;
}

static int64_t mem_preadv(const ss_os *os, int fd, const struct iovec *iov,
                          int iovcnt, int64_t off)
{
    int64_t total = 0;
    for (int i = 0; i < iovcnt; i++) {
        int64_t k =
            mem_pread(os, fd, iov[i].iov_base, iov[i].iov_len, off + total);
        if (k < 0)
            return total > 0 ? total : k;
        total += k;
        if ((size_t)k < iov[i].iov_len)
            break;
    }
    return total;
}

static int mem_nothing(const ss_os *os, int fd)
{
    return file_of(os, fd) != NULL ? 0 : -EBADF;
}

static int mem_fsize(const ss_os *os, int fd, int64_t *size)
{
    const ss_memfile *f = file_of(os, fd);
    if (f == NULL)
        return -EBADF;
    *size = (int64_t)f->size;
    return 0;
}

static int mem_ftruncate(const ss_os *os, int fd, int64_t size)
{
    const ss_memfile *f = file_of(os, fd);
    if (f == NULL)
        return -EBADF;
    return size >= 0 && (uint64_t)size <= f->size ? 0 : -EFBIG;
}

static int mem_paths(const ss_os *os, const char *a, const char *b)
{
    (void)os;
    (void)a;
    (void)b;
    return -ENOTSUP;
}

static int mem_path(const ss_os *os, const char *a)
{
    (void)os;
    (void)a;
    return -ENOTSUP;
}

static int mem_writeback(const ss_os *os, int fd, int64_t off, int64_t n)
{
    (void)off;
    (void)n;
    return mem_nothing(os, fd);
}

static int mem_mmap(const ss_os *os, int fd, size_t n, void **addr)
{
    (void)os;
    (void)fd;
    (void)n;
    (void)addr;
    return -ENOTSUP;
}

static int mem_munmap(const ss_os *os, void *addr, size_t n)
{
    (void)os;
    (void)addr;
    (void)n;
    return 0;
}

void ss_memos_init(ss_memos *m, const ss_memfile *files, size_t n)
{
    m->os = (ss_os){.ctx = m,
                    .open = mem_open,
                    .close = mem_close,
                    .pwrite = mem_pwrite,
                    .pread = mem_pread,
                    .preadv = mem_preadv,
                    .fsync = mem_nothing,
                    .fsize = mem_fsize,
                    .ftruncate = mem_ftruncate,
                    .rename = mem_paths,
                    .unlink = mem_path,
                    .fsync_dir = mem_path,
                    .writeback = mem_writeback,
                    .mmap = mem_mmap,
                    .munmap = mem_munmap,
                    .mkdir = mem_path};
    m->files = files;
    m->n = n;
}
