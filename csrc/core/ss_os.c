/* ss_os.c - the POSIX vtable and the fault injector.
 *
 * Invariants of ss_faults: calls[op] only grows (until reset); arms[0..narms)
 * are guarded by mu, and an arm matches exactly one call number, so it fires
 * at most once. The counters are atomics so counting never takes the lock;
 * the lock is held only to look an arm up (cheap next to a syscall).
 */
#include "ss_os.h"
#include "ss_error.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- POSIX -------------------------------------------------------------- */

static int px_open(const ss_os *os, const char *path, int flags, int mode)
{
    (void)os;
    int fd = open(path, flags, (mode_t)mode);
    return fd < 0 ? -errno : fd;
}

static int px_close(const ss_os *os, int fd)
{
    (void)os;
    return close(fd) < 0 ? -errno : 0;
}

static int64_t px_pwrite(const ss_os *os, int fd, const void *buf, size_t n,
                         int64_t off)
{
    (void)os;
    ssize_t k = pwrite(fd, buf, n, (off_t)off);
    return k < 0 ? -errno : (int64_t)k;
}

static int64_t px_pread(const ss_os *os, int fd, void *buf, size_t n,
                        int64_t off)
{
    (void)os;
    ssize_t k = pread(fd, buf, n, (off_t)off);
    return k < 0 ? -errno : (int64_t)k;
}

static int64_t px_preadv(const ss_os *os, int fd, const struct iovec *iov,
                         int iovcnt, int64_t off)
{
    (void)os;
    ssize_t k = preadv(fd, iov, iovcnt, (off_t)off);
    return k < 0 ? -errno : (int64_t)k;
}

static int px_fsync(const ss_os *os, int fd)
{
    (void)os;
    return fsync(fd) < 0 ? -errno : 0;
}

static int px_fsize(const ss_os *os, int fd, int64_t *size)
{
    struct stat st;
    (void)os;
    if (fstat(fd, &st) < 0)
        return -errno;
    /* Only a regular file has a size worth trusting: a FIFO, a device or a
     * directory read as checkpoint data would block, never end or fail. */
    if (!S_ISREG(st.st_mode))
        return SS_ENOTREG;
    *size = (int64_t)st.st_size;
    return 0;
}

static int px_ftruncate(const ss_os *os, int fd, int64_t size)
{
    (void)os;
    return ftruncate(fd, (off_t)size) < 0 ? -errno : 0;
}

static int px_rename(const ss_os *os, const char *from, const char *to)
{
    (void)os;
    return rename(from, to) < 0 ? -errno : 0;
}

static int px_unlink(const ss_os *os, const char *path)
{
    (void)os;
    return unlink(path) < 0 ? -errno : 0;
}

static int px_fsync_dir(const ss_os *os, const char *dir)
{
    int rc = 0;
    (void)os;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    if (fsync(fd) < 0)
        rc = -errno;
    close(fd);
    return rc;
}

static int px_writeback(const ss_os *os, int fd, int64_t off, int64_t n)
{
    (void)os;
#if defined(__linux__)
    if (sync_file_range(fd, (off_t)off, (off_t)n, SYNC_FILE_RANGE_WRITE) < 0)
        return -errno;
#else
    (void)fd;
    (void)off;
    (void)n;
#endif
    return 0;
}

static int px_mmap(const ss_os *os, int fd, size_t n, void **addr)
{
    (void)os;
    void *p = mmap(NULL, n, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return -errno;
    *addr = p;
    return 0;
}

static int px_munmap(const ss_os *os, void *addr, size_t n)
{
    (void)os;
    return munmap(addr, n) < 0 ? -errno : 0;
}

static int px_mkdir(const ss_os *os, const char *path)
{
    (void)os;
    return mkdir(path, 0777) < 0 ? -errno : 0;
}

static const ss_os posix_os = {
    NULL,         px_open,  px_close,     px_pwrite, px_pread,  px_preadv,
    px_fsync,     px_fsize, px_ftruncate, px_rename, px_unlink, px_fsync_dir,
    px_writeback, px_mmap,  px_munmap,    px_mkdir,
};

const ss_os *ss_os_default(void)
{
    return &posix_os;
}

static const char *const op_names[SS_OS_NOPS] = {
#define SS__OP_NAME(name, str) str,
    SS_OS_OPS(SS__OP_NAME)
#undef SS__OP_NAME
};

const char *ss_os_op_name(int op)
{
    return op >= 0 && op < SS_OS_NOPS ? op_names[op] : NULL;
}

int ss_os_op_from_name(const char *name)
{
    for (int i = 0; i < SS_OS_NOPS; i++)
        if (strcmp(name, op_names[i]) == 0)
            return i;
    return -1;
}

/* ---- fault injector ----------------------------------------------------- */

enum { ARM_NONE, ARM_FAIL, ARM_SHORT, ARM_EINTR, ARM_KILL };

typedef struct {
    int op;
    int kind;
    uint64_t at;  /* 1-based call number */
    size_t value; /* errno for ARM_FAIL, byte count for ARM_SHORT */
} arm;

struct ss_faults {
    ss_os vt; /* vt.ctx points back here */
    const ss_os *base;
    _Atomic uint64_t calls[SS_OS_NOPS];
    pthread_mutex_t mu;
    arm arms[SS_FAULTS_MAX_ARMS];
    int narms;
};

/* Count one call of op; return the kind of the arm it hits (copied to *a). */
static int hit(const ss_os *os, int op, arm *a)
{
    ss_faults *f = os->ctx;
    uint64_t n = atomic_fetch_add(&f->calls[op], 1) + 1;
    int kind = ARM_NONE;

    pthread_mutex_lock(&f->mu);
    for (int i = 0; i < f->narms; i++) {
        if (f->arms[i].op == op && f->arms[i].at == n) {
            *a = f->arms[i];
            kind = a->kind;
            break;
        }
    }
    pthread_mutex_unlock(&f->mu);
    if (kind == ARM_KILL) {
        raise(SIGKILL);
        for (;;) /* SIGKILL cannot be caught: delivery is only a moment away */
            pause();
    }
    return kind;
}

static const ss_os *base_of(const ss_os *os)
{
    return ((const ss_faults *)os->ctx)->base;
}

/* For ops that do nothing when a fault hits: fail or EINTR, else go on. */
#define SS__INJECT(os, op)                                                     \
    do {                                                                       \
        arm a_;                                                                \
        int k_ = hit(os, op, &a_);                                             \
        if (k_ == ARM_FAIL)                                                    \
            return -(int)a_.value;                                             \
        if (k_ == ARM_EINTR)                                                   \
            return -EINTR;                                                     \
    } while (0)

static int fi_open(const ss_os *os, const char *path, int flags, int mode)
{
    SS__INJECT(os, SS_OS_OPEN);
    return base_of(os)->open(base_of(os), path, flags, mode);
}

/* close really closes even when it reports a failure, as Linux does. */
static int fi_close(const ss_os *os, int fd)
{
    arm a;
    int kind = hit(os, SS_OS_CLOSE, &a);
    int rc = base_of(os)->close(base_of(os), fd);
    if (kind == ARM_FAIL)
        return -(int)a.value;
    if (kind == ARM_EINTR)
        return -EINTR;
    return rc;
}

/* The armed fault, if any, of one pwrite/pread: a negative code to return
 * instead of the call, or 0 with *n possibly cut short. */
static int xfer_fault(const ss_os *os, int op, size_t *n)
{
    arm a;
    int kind = hit(os, op, &a);
    if (kind == ARM_FAIL)
        return -(int)a.value;
    if (kind == ARM_EINTR)
        return -EINTR;
    if (kind == ARM_SHORT && a.value < *n)
        *n = a.value;
    return 0;
}

static int64_t fi_pwrite(const ss_os *os, int fd, const void *buf, size_t n,
                         int64_t off)
{
    int rc = xfer_fault(os, SS_OS_PWRITE, &n);
    if (rc < 0)
        return rc;
    return base_of(os)->pwrite(base_of(os), fd, buf, n, off);
}

static int64_t fi_pread(const ss_os *os, int fd, void *buf, size_t n,
                        int64_t off)
{
    int rc = xfer_fault(os, SS_OS_PREAD, &n);
    if (rc < 0)
        return rc;
    if (n == 0)
        return 0;
    return base_of(os)->pread(base_of(os), fd, buf, n, off);
}

/* A short arm reads only its first m bytes: the iovecs cut to m. */
static int64_t fi_preadv(const ss_os *os, int fd, const struct iovec *iov,
                         int iovcnt, int64_t off)
{
    struct iovec cut[SS_OS_MAX_IOV];
    size_t n = 0;
    int rc;

    if (iovcnt < 0 || iovcnt > SS_OS_MAX_IOV)
        return -EINVAL;
    for (int i = 0; i < iovcnt; i++)
        n += iov[i].iov_len;
    size_t want = n;
    rc = xfer_fault(os, SS_OS_PREADV, &n);
    if (rc < 0)
        return rc;
    if (n == want)
        return base_of(os)->preadv(base_of(os), fd, iov, iovcnt, off);
    if (n == 0)
        return 0;
    int k = 0;
    for (size_t left = n; left > 0 && k < iovcnt; k++) {
        cut[k] = iov[k];
        if (cut[k].iov_len > left)
            cut[k].iov_len = left;
        left -= cut[k].iov_len;
    }
    return base_of(os)->preadv(base_of(os), fd, cut, k, off);
}

static int fi_fsync(const ss_os *os, int fd)
{
    SS__INJECT(os, SS_OS_FSYNC);
    return base_of(os)->fsync(base_of(os), fd);
}

static int fi_fsize(const ss_os *os, int fd, int64_t *size)
{
    SS__INJECT(os, SS_OS_FSIZE);
    return base_of(os)->fsize(base_of(os), fd, size);
}

static int fi_ftruncate(const ss_os *os, int fd, int64_t size)
{
    SS__INJECT(os, SS_OS_FTRUNCATE);
    return base_of(os)->ftruncate(base_of(os), fd, size);
}

static int fi_rename(const ss_os *os, const char *from, const char *to)
{
    SS__INJECT(os, SS_OS_RENAME);
    return base_of(os)->rename(base_of(os), from, to);
}

static int fi_unlink(const ss_os *os, const char *path)
{
    SS__INJECT(os, SS_OS_UNLINK);
    return base_of(os)->unlink(base_of(os), path);
}

static int fi_fsync_dir(const ss_os *os, const char *dir)
{
    SS__INJECT(os, SS_OS_FSYNC_DIR);
    return base_of(os)->fsync_dir(base_of(os), dir);
}

static int fi_writeback(const ss_os *os, int fd, int64_t off, int64_t n)
{
    SS__INJECT(os, SS_OS_WRITEBACK);
    return base_of(os)->writeback(base_of(os), fd, off, n);
}

static int fi_mmap(const ss_os *os, int fd, size_t n, void **addr)
{
    SS__INJECT(os, SS_OS_MMAP);
    return base_of(os)->mmap(base_of(os), fd, n, addr);
}

static int fi_munmap(const ss_os *os, void *addr, size_t n)
{
    return base_of(os)->munmap(base_of(os), addr, n);
}

static int fi_mkdir(const ss_os *os, const char *path)
{
    SS__INJECT(os, SS_OS_MKDIR);
    return base_of(os)->mkdir(base_of(os), path);
}

int ss_faults_new(ss_faults **out, const ss_os *base)
{
    ss_faults *f = calloc(1, sizeof *f);

    *out = NULL;
    if (f == NULL)
        return SS_ENOMEM;
    f->vt =
        (ss_os){f,         fi_open,      fi_close,     fi_pwrite,    fi_pread,
                fi_preadv, fi_fsync,     fi_fsize,     fi_ftruncate, fi_rename,
                fi_unlink, fi_fsync_dir, fi_writeback, fi_mmap,      fi_munmap,
                fi_mkdir};
    f->base = base != NULL ? base : ss_os_default();
    for (int i = 0; i < SS_OS_NOPS; i++)
        atomic_init(&f->calls[i], 0);
    pthread_mutex_init(&f->mu, NULL);
    *out = f;
    return 0;
}

void ss_faults_free(ss_faults *f)
{
    if (f == NULL)
        return;
    pthread_mutex_destroy(&f->mu);
    free(f);
}

const ss_os *ss_faults_os(const ss_faults *f)
{
    return &f->vt;
}

static int add_arm(ss_faults *f, int op, int kind, uint64_t at, size_t value)
{
    int rc = 0;
    if (op < 0 || op >= SS_OS_NOPS || at == 0)
        return SS_EINVAL;
    pthread_mutex_lock(&f->mu);
    if (f->narms == SS_FAULTS_MAX_ARMS)
        rc = SS_EINVAL;
    else
        f->arms[f->narms++] = (arm){op, kind, at, value};
    pthread_mutex_unlock(&f->mu);
    return rc;
}

int ss_faults_fail(ss_faults *f, int op, uint64_t at_call, int err)
{
    if (err <= 0 || err >= 1000)
        return SS_EINVAL;
    return add_arm(f, op, ARM_FAIL, at_call, (size_t)err);
}

int ss_faults_short(ss_faults *f, int op, uint64_t at_call, size_t nbytes)
{
    if (op != SS_OS_PWRITE && op != SS_OS_PREAD && op != SS_OS_PREADV)
        return SS_EINVAL;
    return add_arm(f, op, ARM_SHORT, at_call, nbytes);
}

int ss_faults_eintr(ss_faults *f, int op, uint64_t at_call)
{
    return add_arm(f, op, ARM_EINTR, at_call, 0);
}

int ss_faults_kill(ss_faults *f, int op, uint64_t at_call)
{
    return add_arm(f, op, ARM_KILL, at_call, 0);
}

uint64_t ss_faults_calls(const ss_faults *f, int op)
{
    if (op < 0 || op >= SS_OS_NOPS)
        return 0;
    /* atomic_load takes a non-const pointer in some C11 libraries */
    return atomic_load(&((ss_faults *)f)->calls[op]);
}

void ss_faults_reset(ss_faults *f)
{
    pthread_mutex_lock(&f->mu);
    f->narms = 0;
    for (int i = 0; i < SS_OS_NOPS; i++)
        atomic_store(&f->calls[i], 0);
    pthread_mutex_unlock(&f->mu);
}
