/* ss_os.h - the operating-system calls used by file I/O, as a vtable, plus
 * a fault injector that wraps any vtable.
 *
 * Every entry returns 0 (or a byte count / descriptor) on success and
 * -errno on failure; none of them retries EINTR or loops over short
 * transfers (that is ss_io.c's job, in one place). Each entry receives the
 * vtable itself so a wrapper can find its state in os->ctx.
 *
 * ss_os_default() is plain POSIX. ss_faults wraps a base vtable: it counts
 * the calls of each operation (atomically: batch I/O calls from many
 * threads) and, when armed, makes call number k (1-based) of an operation
 * fail with a chosen errno, transfer only m bytes (pwrite/pread/preadv),
 * fail once with EINTR, or kill the process with SIGKILL before the call
 * is made (crash-consistency tests: the call and everything after it never
 * happen, as when the machine loses power there). Several arms may be set at
 * once; each fires at most once (call numbers are never reused until
 * ss_faults_reset).
 *
 * An injected failure of close still closes the descriptor (as Linux
 * close() does when it reports an error), so injected faults never leak.
 *
 * Thread safety: ss_os_default() is immutable. An ss_faults may be used
 * from any number of threads; arming, counting and resetting may race with
 * calls through its vtable.
 */
#ifndef SS_OS_H
#define SS_OS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

typedef struct ss_os ss_os;

struct ss_os {
    void *ctx; /* the wrapper's state; NULL for the default */
    /* open(2); returns a descriptor >= 0. */
    int (*open)(const ss_os *os, const char *path, int flags, int mode);
    int (*close)(const ss_os *os, int fd);
    /* One pwrite(2)/pread(2): bytes transferred (may be short) or -errno. */
    int64_t (*pwrite)(const ss_os *os, int fd, const void *buf, size_t n,
                      int64_t off);
    int64_t (*pread)(const ss_os *os, int fd, void *buf, size_t n, int64_t off);
    /* One preadv(2) of iovcnt (<= SS_OS_MAX_IOV) buffers: bytes read (may
     * be short) or -errno. */
    int64_t (*preadv)(const ss_os *os, int fd, const struct iovec *iov,
                      int iovcnt, int64_t off);
    int (*fsync)(const ss_os *os, int fd);
    /* fstat size; SS_ENOTREG for anything but a regular file. */
    int (*fsize)(const ss_os *os, int fd, int64_t *size);
    int (*ftruncate)(const ss_os *os, int fd, int64_t size);
    int (*rename)(const ss_os *os, const char *from, const char *to);
    int (*unlink)(const ss_os *os, const char *path);
    /* Open the directory read-only, fsync it, close it. */
    int (*fsync_dir)(const ss_os *os, const char *dir);
    /* Start writeback of [off, off + n) without waiting for it (Linux
     * sync_file_range WRITE); 0 where the system has no such call. */
    int (*writeback)(const ss_os *os, int fd, int64_t off, int64_t n);
    /* Map n > 0 bytes of fd read-only and shared into *addr. */
    int (*mmap)(const ss_os *os, int fd, size_t n, void **addr);
    /* Unmap what mmap mapped (not counted, never injected: it releases). */
    int (*munmap)(const ss_os *os, void *addr, size_t n);
    /* mkdir(2) of one directory, mode 0777 less the umask. */
    int (*mkdir)(const ss_os *os, const char *path);
};

/* The most buffers one preadv is given (well under every IOV_MAX). */
#define SS_OS_MAX_IOV 128

/* The operations, for counting and arming faults. */
#define SS_OS_OPS(X)                                                           \
    X(SS_OS_OPEN, "open")                                                      \
    X(SS_OS_CLOSE, "close")                                                    \
    X(SS_OS_PWRITE, "pwrite")                                                  \
    X(SS_OS_PREAD, "pread")                                                    \
    X(SS_OS_PREADV, "preadv")                                                  \
    X(SS_OS_FSYNC, "fsync")                                                    \
    X(SS_OS_FSIZE, "fstat")                                                    \
    X(SS_OS_FTRUNCATE, "ftruncate")                                            \
    X(SS_OS_RENAME, "rename")                                                  \
    X(SS_OS_UNLINK, "unlink")                                                  \
    X(SS_OS_FSYNC_DIR, "fsync_dir")                                            \
    X(SS_OS_WRITEBACK, "writeback")                                            \
    X(SS_OS_MMAP, "mmap")                                                      \
    X(SS_OS_MKDIR, "mkdir")

typedef enum {
#define SS__OP_ENUM(name, str) name,
    SS_OS_OPS(SS__OP_ENUM)
#undef SS__OP_ENUM
        SS_OS_NOPS
} ss_os_op;

/* Plain POSIX. Never NULL. */
const ss_os *ss_os_default(void);

/* "pwrite" etc. for op, or NULL when out of range. */
const char *ss_os_op_name(int op);
/* The op named name, or -1. */
int ss_os_op_from_name(const char *name);

typedef struct ss_faults ss_faults;

#define SS_FAULTS_MAX_ARMS 64

/* Wrap base (NULL = ss_os_default()). 0 or SS_ENOMEM. */
int ss_faults_new(ss_faults **out, const ss_os *base);
void ss_faults_free(ss_faults *f); /* NULL is a no-op */

/* The vtable to hand to ss_io; valid until ss_faults_free. */
const ss_os *ss_faults_os(const ss_faults *f);

/* Arm call number at_call (>= 1) of op. err > 0 is the errno to return.
 * Each returns 0, or SS_EINVAL for a bad op/at_call/err or when
 * SS_FAULTS_MAX_ARMS arms are already set. */
int ss_faults_fail(ss_faults *f, int op, uint64_t at_call, int err);
/* Call at_call of pwrite/pread/preadv transfers at most nbytes (a short
 * transfer, not an error; nbytes 0 looks like end of file to a read). */
int ss_faults_short(ss_faults *f, int op, uint64_t at_call, size_t nbytes);
/* Call at_call of op returns -EINTR without doing anything. */
int ss_faults_eintr(ss_faults *f, int op, uint64_t at_call);
/* Call at_call of op sends SIGKILL to the calling process instead. */
int ss_faults_kill(ss_faults *f, int op, uint64_t at_call);

/* Calls of op made so far (including failed ones); 0 for a bad op. */
uint64_t ss_faults_calls(const ss_faults *f, int op);
/* Disarm everything and zero the counters. */
void ss_faults_reset(ss_faults *f);

#endif /* SS_OS_H */
