/* ss_io.c - batch write/read over a pool, the transfer loops, raw baselines.
 *
 * A batch runs in phases, each finished before the next starts:
 *   validate jobs -> open (and size, or stat) every file -> one pool task
 *   per piece -> fsync every file (write, if asked) -> close every file ->
 *   combine piece CRCs per job (and verify, on reads).
 * Workers share the batch by reading its tables; the only things they write
 * are their own piece_crc slots and, under mu, the first error. `failed` is
 * set after the first error so later pieces skip their work. On reads,
 * consecutive small whole jobs of one file form a run that the first
 * piece's task reads with one preadv (the others' tasks do nothing).
 *
 * ss_io_write_all/ss_io_read_all/readv_all are the only transfer loops of
 * the core (ss_file uses the first two): they
 * retry EINTR, continue after short transfers and cap each call at
 * SS_IO_MAX_XFER (a run is at most one piece). Every other call that may report
 * EINTR is retried by RETRY, except close (on Linux the descriptor is gone
 * after any close).
 */
#include "ss_io.h"
#include "ss_crc.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
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

/* Write len bytes at off. On failure *at is the offset that failed. */
int ss_io_write_all(const ss_os *os, int fd, const void *buf, uint64_t len,
                    int64_t off, int64_t *at)
{
    const char *p = buf;
    while (len > 0) {
        size_t n = len < SS_IO_MAX_XFER ? (size_t)len : SS_IO_MAX_XFER;
        int64_t k = os->pwrite(os, fd, p, n, off);
        if (k == -EINTR)
            continue;
        if (k <= 0) {
            *at = off;
            return k < 0 ? (int)k : -EIO; /* 0 for n > 0: no progress */
        }
        p += k;
        off += k;
        len -= (uint64_t)k;
    }
    return 0;
}

/* Read len bytes at off; end of file before len is SS_ESHORT. */
int ss_io_read_all(const ss_os *os, int fd, void *buf, uint64_t len,
                   int64_t off, int64_t *at)
{
    char *p = buf;
    while (len > 0) {
        size_t n = len < SS_IO_MAX_XFER ? (size_t)len : SS_IO_MAX_XFER;
        int64_t k = os->pread(os, fd, p, n, off);
        if (k == -EINTR)
            continue;
        if (k <= 0) {
            *at = off;
            return k < 0 ? (int)k : SS_ESHORT;
        }
        p += k;
        off += k;
        len -= (uint64_t)k;
    }
    return 0;
}

/* Read the iovecs' total at off with as many preadv calls as it takes;
 * iov is consumed. End of file first is SS_ESHORT. */
static int readv_all(const ss_os *os, int fd, struct iovec *iov, int cnt,
                     int64_t off, int64_t *at)
{
    while (cnt > 0) {
        int64_t k = os->preadv(os, fd, iov, cnt, off);
        if (k == -EINTR)
            continue;
        if (k <= 0) {
            *at = off;
            return k < 0 ? (int)k : SS_ESHORT;
        }
        off += k;
        while (cnt > 0 && (uint64_t)k >= iov->iov_len) {
            k -= (int64_t)iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (char *)iov->iov_base + k;
            iov->iov_len -= (size_t)k;
        }
    }
    return 0;
}

/* ---- batches ------------------------------------------------------------ */

typedef struct {
    size_t job;
    uint64_t start; /* offset of the piece within its job */
    uint64_t len;
    /* Reads: how many pieces (this one and the next run - 1, each a whole
     * small job) this piece's task reads with one preadv; 0 for a piece
     * read by an earlier one's task. Writes: always 1. */
    uint32_t run;
    size_t item; /* device writes: the piece's ss_stage item, else SIZE_MAX */
} piece;

typedef struct {
    const ss_os *os;
    const char *const *paths;
    int *fds;
    const ss_io_wjob *w; /* exactly one of w, r is set */
    const ss_io_rjob *r;
    piece *pieces;
    uint32_t *piece_crc;
    int checksum;  /* every job's CRC is computed */
    int verify;    /* read jobs with has_crc get theirs computed and checked */
    int writeback; /* written pieces get their writeback started */
    int patch;     /* write into existing files, keeping their size */
    ss_stage *stage;      /* for device jobs, once its batch has begun */
    size_t dsize;         /* device piece size; 0 when there is no stage */
    ss_stage_item *items; /* device writes, in piece order */
    size_t nitems;
    /* Reads: piece-sized buffers for discard jobs, kept for reuse under mu
     * (as many as discard pieces ever ran at once: bounded by the tasks). */
    void **spare;
    size_t nspare, capspare, psize;
    atomic_int failed;
    pthread_mutex_t mu;
    ss_errinfo first;
} batch;

/* A read job whose bytes are only checksummed (into scratch). */
static int job_discard(const batch *b, size_t j)
{
    return b->r != NULL && b->r[j].discard;
}
static int job_dev(const batch *b, size_t j)
{
    return b->w != NULL ? b->w[j].dev : b->r[j].dev;
}
static uint64_t job_len(const batch *b, size_t j)
{
    return b->w != NULL ? b->w[j].len : b->r[j].len;
}
static uint32_t job_file(const batch *b, size_t j)
{
    return b->w != NULL ? b->w[j].file : b->r[j].file;
}
static int64_t job_offset(const batch *b, size_t j)
{
    return b->w != NULL ? b->w[j].offset : b->r[j].offset;
}

/* Whether job j's CRC is computed (a discard job's always is). */
static int wants_crc(const batch *b, size_t j)
{
    return b->checksum || job_discard(b, j) ||
           (b->r != NULL && b->verify && b->r[j].has_crc);
}

/* Keep the first failure (any thread). job < 0 when none is involved. */
static void record(batch *b, int rc, const char *op, const char *path,
                   int64_t off, int64_t job)
{
    pthread_mutex_lock(&b->mu);
    if (b->first.code == 0) {
        ss_errinfo_set(&b->first, rc, op, path, off, NULL);
        b->first.job = job;
    }
    pthread_mutex_unlock(&b->mu);
    atomic_store(&b->failed, 1);
    if (b->stage != NULL) /* wake threads waiting for a copy or a buffer */
        ss__stage_cancel(b->stage);
}

static int has_failed(batch *b)
{
    return atomic_load_explicit(&b->failed, memory_order_relaxed);
}

/* A piece-sized buffer for discard bytes: one of the batch's spares (taken
 * from, then given back to, its list under mu), or a new one; NULL when out
 * of memory. */
static void *take_spare(batch *b)
{
    void *p = NULL;
    pthread_mutex_lock(&b->mu);
    if (b->nspare > 0)
        p = b->spare[--b->nspare];
    pthread_mutex_unlock(&b->mu);
    return p != NULL ? p : malloc(b->psize);
}

static void give_spare(batch *b, void *p)
{
    pthread_mutex_lock(&b->mu);
    if (p != NULL && b->nspare < b->capspare) {
        b->spare[b->nspare++] = p;
        p = NULL;
    }
    pthread_mutex_unlock(&b->mu);
    free(p);
}

/* Where piece k of a run reads to: its job's buffer, or for a discard
 * job the next free bytes of the run's spare (*used advances). */
static char *run_dst(const batch *b, const piece *pc, char *spare, size_t *used)
{
    char *p;
    if (!job_discard(b, pc->job))
        return (char *)b->r[pc->job].dst;
    p = spare + *used;
    *used += (size_t)pc->len;
    return p;
}

/* Pieces i .. i + run - 1 (whole small jobs of one file, ascending, small
 * gaps) with one preadv, then each one's CRC. A run spans at most a piece,
 * so its discard jobs' bytes fit one spare buffer. */
static void read_run(batch *b, size_t i, uint32_t file, int64_t off)
{
    struct iovec iov[SS_OS_MAX_IOV];
    /* Where the gap bytes go (never read back): the task's own, since pool
     * threads run runs at once and the kernel writes every gap it reads. */
    char discard[SS_IO_COALESCE_GAP];
    char *spare = NULL;
    size_t used = 0;
    int cnt = 0;
    int64_t at = -1, end = off;

    for (size_t k = i; k < i + b->pieces[i].run; k++) {
        if (job_discard(b, b->pieces[k].job) && spare == NULL &&
            (spare = take_spare(b)) == NULL) {
            record(b, SS_ENOMEM, "malloc", b->paths[file], off,
                   (int64_t)b->pieces[k].job);
            return;
        }
    }
    for (size_t k = i; k < i + b->pieces[i].run; k++) {
        const piece *pc = &b->pieces[k];
        int64_t start = job_offset(b, pc->job);
        if (start > end)
            iov[cnt++] = (struct iovec){discard, (size_t)(start - end)};
        iov[cnt++] =
            (struct iovec){run_dst(b, pc, spare, &used), (size_t)pc->len};
        end = start + (int64_t)pc->len;
    }
    int rc = readv_all(b->os, b->fds[file], iov, cnt, off, &at);
    if (rc < 0) {
        record(b, rc, "preadv", b->paths[file], at, (int64_t)b->pieces[i].job);
        give_spare(b, spare);
        return;
    }
    used = 0;
    for (size_t k = i; k < i + b->pieces[i].run; k++) {
        const piece *pc = &b->pieces[k];
        const char *p = run_dst(b, pc, spare, &used);
        if (wants_crc(b, pc->job))
            b->piece_crc[k] = ss_crc32(0, p, pc->len);
    }
    give_spare(b, spare);
}

/* Whether piece k can join a run that ends (its data) at end in file. */
static int joins_run(const batch *b, size_t k, uint32_t file, int64_t end)
{
    const piece *pc = &b->pieces[k];
    int64_t start = job_offset(b, pc->job);
    return pc->start == 0 && pc->len == job_len(b, pc->job) &&
           !job_dev(b, pc->job) && pc->len <= SS_IO_COALESCE_JOB &&
           job_file(b, pc->job) == file && start >= end &&
           (uint64_t)(start - end) <= SS_IO_COALESCE_GAP;
}

/* Reads: group consecutive small whole-job pieces into runs. */
static void coalesce(batch *b, size_t n, size_t psize)
{
    for (size_t k = 0; k < n;) {
        const piece *pc = &b->pieces[k];
        uint32_t file = job_file(b, pc->job);
        int64_t first = job_offset(b, pc->job);
        int64_t end = first + (int64_t)pc->len;
        size_t m = 1;
        if (pc->start == 0 && pc->len == job_len(b, pc->job) &&
            !job_dev(b, pc->job) && pc->len <= SS_IO_COALESCE_JOB) {
            while (k + m < n && m < SS_OS_MAX_IOV / 2 &&
                   joins_run(b, k + m, file, end)) {
                const piece *nx = &b->pieces[k + m];
                int64_t nend = job_offset(b, nx->job) + (int64_t)nx->len;
                if ((uint64_t)(nend - first) > psize)
                    break;
                end = nend;
                m++;
            }
        }
        b->pieces[k].run = (uint32_t)m;
        for (size_t f = 1; f < m; f++)
            b->pieces[k + f].run = 0;
        k += m;
    }
}

/* Start writeback of a piece just written: only a hint, so a file system
 * without it is no error, but a write error it reports early (EIO, ENOSPC)
 * is. */
static void start_writeback(batch *b, uint32_t file, int64_t off, uint64_t len,
                            size_t job)
{
    if (!b->writeback || len == 0)
        return;
    int rc = b->os->writeback(b->os, b->fds[file], off, (int64_t)len);
    if (rc < 0 && rc != -EINVAL && rc != -ENOSYS && rc != -ESPIPE &&
        rc != -EOPNOTSUPP && rc != -EINTR)
        record(b, rc, "writeback", b->paths[file], off, (int64_t)job);
}

/* A device piece of a write: wait for its staged copy, write it, give the
 * buffer back (which queues the copy of a later piece into it). */
static void dev_write(batch *b, size_t i, uint32_t file, int64_t off)
{
    const piece *pc = &b->pieces[i];
    const void *p = NULL;
    int64_t at = -1;
    int rc = ss__stage_take(b->stage, pc->item, &p);

    if (rc < 0) {
        if (rc != SS_ECANCELED) /* else the failure is recorded already */
            record(b, rc, "device copy", b->paths[file], off, (int64_t)pc->job);
        return;
    }
    if (b->checksum)
        b->piece_crc[i] = ss_crc32(0, p, pc->len);
    rc = ss_io_write_all(b->os, b->fds[file], p, pc->len, off, &at);
    ss__stage_give(b->stage, pc->item);
    if (rc < 0)
        record(b, rc, "pwrite", b->paths[file], at, (int64_t)pc->job);
    else
        start_writeback(b, file, off, pc->len, pc->job);
}

/* A device piece of a read: read it into a free staging buffer, check it,
 * queue its copy to the device. */
static void dev_read(batch *b, size_t i, uint32_t file, int64_t off)
{
    const piece *pc = &b->pieces[i];
    void *p = NULL;
    size_t slot = 0;
    int64_t at = -1;
    int rc = ss__stage_buffer(b->stage, &p, &slot);

    if (rc < 0) {
        if (rc != SS_ECANCELED)
            record(b, rc, "device copy", b->paths[file], off, (int64_t)pc->job);
        return;
    }
    rc = ss_io_read_all(b->os, b->fds[file], p, pc->len, off, &at);
    if (rc < 0) {
        ss__stage_put(b->stage, slot);
        record(b, rc, "pread", b->paths[file], at, (int64_t)pc->job);
        return;
    }
    if (wants_crc(b, pc->job))
        b->piece_crc[i] = ss_crc32(0, p, pc->len);
    rc = ss__stage_h2d(b->stage, slot, (char *)b->r[pc->job].dst + pc->start,
                       (size_t)pc->len);
    if (rc < 0 && rc != SS_ECANCELED)
        record(b, rc, "device copy", b->paths[file], off, (int64_t)pc->job);
}

/* A discard piece: read into a spare buffer, checksum it. */
static void discard_read(batch *b, size_t i, uint32_t file, int64_t off)
{
    const piece *pc = &b->pieces[i];
    void *p = take_spare(b);
    int64_t at = -1;
    int rc;

    if (p == NULL) {
        record(b, SS_ENOMEM, "malloc", b->paths[file], off, (int64_t)pc->job);
        return;
    }
    rc = ss_io_read_all(b->os, b->fds[file], p, pc->len, off, &at);
    if (rc < 0)
        record(b, rc, "pread", b->paths[file], at, (int64_t)pc->job);
    else
        b->piece_crc[i] = ss_crc32(0, p, pc->len);
    give_spare(b, p);
}

static void piece_task(void *ctx, size_t i)
{
    batch *b = ctx;
    const piece *pc = &b->pieces[i];
    uint32_t file = job_file(b, pc->job);
    int64_t off = job_offset(b, pc->job) + (int64_t)pc->start, at = -1;
    int rc;

    if (has_failed(b))
        return;
    if (pc->item != SIZE_MAX) {
        dev_write(b, i, file, off);
    } else if (b->r != NULL && b->r[pc->job].dev) {
        dev_read(b, i, file, off);
    } else if (pc->run == 1 && job_discard(b, pc->job)) {
        discard_read(b, i, file, off);
    } else if (b->w != NULL) {
        const char *p = (const char *)b->w[pc->job].src + pc->start;
        if (b->checksum) /* just before the write: the bytes stay in cache */
            b->piece_crc[i] = ss_crc32(0, p, pc->len);
        rc = ss_io_write_all(b->os, b->fds[file], p, pc->len, off, &at);
        if (rc < 0)
            record(b, rc, "pwrite", b->paths[file], at, (int64_t)pc->job);
        else
            start_writeback(b, file, off, pc->len, pc->job);
    } else if (pc->run == 1) {
        char *p = (char *)b->r[pc->job].dst + pc->start;
        rc = ss_io_read_all(b->os, b->fds[file], p, pc->len, off, &at);
        if (rc < 0)
            record(b, rc, "pread", b->paths[file], at, (int64_t)pc->job);
        else if (wants_crc(b, pc->job)) /* right after the read, while hot */
            b->piece_crc[i] = ss_crc32(0, p, pc->len);
    } else if (pc->run > 1) {
        read_run(b, i, file, off);
    }
}

static void fsync_task(void *ctx, size_t i)
{
    batch *b = ctx;
    int rc;
    if (has_failed(b))
        return;
    RETRY(rc, b->os->fsync(b->os, b->fds[i]));
    if (rc < 0)
        record(b, rc, "fsync", b->paths[i], -1, -1);
}

/* Jobs name existing files and fit in int64 offsets. */
static int validate(batch *b, size_t npaths, size_t njobs)
{
    for (size_t j = 0; j < njobs; j++) {
        uint64_t len = job_len(b, j);
        int64_t off = job_offset(b, j);
        const void *buf = b->w != NULL ? b->w[j].src : b->r[j].dst;
        if (job_discard(b, j) && (buf != NULL || job_dev(b, j))) {
            record(b, SS_EINVAL, "validate", NULL, off, (int64_t)j);
            snprintf(b->first.detail, sizeof b->first.detail,
                     "a discard job has no buffer and is not a device job");
            return SS_EINVAL;
        }
        if (job_file(b, j) >= npaths || off < 0 ||
            len > (uint64_t)(INT64_MAX - off) ||
            (len > 0 && buf == NULL && !job_discard(b, j))) {
            record(b, SS_EINVAL, "validate", NULL, off, (int64_t)j);
            snprintf(b->first.detail, sizeof b->first.detail,
                     "job needs a file index below %zu, offset >= 0, "
                     "offset + length < 2^63 and a buffer",
                     npaths);
            return SS_EINVAL;
        }
        if (job_dev(b, j) && b->dsize == 0) {
            record(b, SS_EINVAL, "validate", NULL, off, (int64_t)j);
            snprintf(b->first.detail, sizeof b->first.detail,
                     "a device job needs a staging pipeline (opts.stage)");
            return SS_EINVAL;
        }
    }
    return 0;
}

/* Open every file; for writes size it to its last job's end, for reads
 * check that every job lies inside it. */
static int open_files(batch *b, size_t npaths, size_t njobs)
{
    const ss_os *os = b->os;
    int64_t *ends = calloc(npaths ? npaths : 1, sizeof *ends);
    int rc = 0;

    if (ends == NULL) {
        record(b, SS_ENOMEM, "malloc", NULL, -1, -1);
        return SS_ENOMEM;
    }
    for (size_t j = 0; j < njobs; j++) {
        int64_t end = job_offset(b, j) + (int64_t)job_len(b, j);
        if (end > ends[job_file(b, j)])
            ends[job_file(b, j)] = end;
    }
    for (size_t f = 0; f < npaths; f++) {
        /* O_NONBLOCK on reads: opening a FIFO must not wait for a writer
         * (fsize then refuses anything but a regular file, on which the
         * flag has no effect). */
        int flags = b->w == NULL ? O_RDONLY | O_CLOEXEC | O_NONBLOCK
                    : b->patch   ? O_WRONLY | O_CLOEXEC
                                 : O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
        RETRY(rc, os->open(os, b->paths[f], flags, 0666));
        if (rc < 0) {
            record(b, rc, "open", b->paths[f], -1, -1);
            goto out;
        }
        b->fds[f] = rc;
        rc = 0;
        if (b->w != NULL && !b->patch && ends[f] > 0) {
            RETRY(rc, os->ftruncate(os, b->fds[f], ends[f]));
            if (rc < 0) {
                record(b, rc, "ftruncate", b->paths[f], ends[f], -1);
                goto out;
            }
        } else if (b->w == NULL) {
            RETRY(rc, os->fsize(os, b->fds[f], &ends[f]));
            if (rc < 0) {
                record(b, rc, "fstat", b->paths[f], -1, -1);
                goto out;
            }
        }
    }
    for (size_t j = 0; b->w == NULL && j < njobs; j++) {
        uint32_t f = job_file(b, j);
        int64_t off = job_offset(b, j);
        uint64_t len = job_len(b, j);
        if (off > ends[f] || len > (uint64_t)(ends[f] - off)) {
            rc = SS_ERANGE;
            record(b, rc, "pread", b->paths[f], off, (int64_t)j);
            snprintf(b->first.detail, sizeof b->first.detail,
                     "%llu bytes requested but the file has %lld bytes",
                     (unsigned long long)len, (long long)ends[f]);
            goto out;
        }
    }
out:
    free(ends);
    return rc;
}

/* Split jobs into pieces; first[j] is job j's first piece (first[njobs]
 * the total). Zero-length jobs have no pieces. */
static int make_pieces(batch *b, size_t njobs, size_t psize, size_t **first)
{
    size_t n = 0, k = 0, items = 0;
    size_t dsize = b->dsize < psize ? b->dsize : psize;

    *first = malloc((njobs + 1) * sizeof **first);
    if (*first == NULL)
        return SS_ENOMEM;
    for (size_t j = 0; j < njobs; j++) {
        size_t ps = job_dev(b, j) ? dsize : psize;
        n += (size_t)((job_len(b, j) + ps - 1) / ps);
    }
    b->pieces = malloc((n ? n : 1) * sizeof *b->pieces);
    b->piece_crc = calloc(n ? n : 1, sizeof *b->piece_crc);
    if (b->pieces == NULL || b->piece_crc == NULL)
        return SS_ENOMEM;
    if (b->w != NULL && b->dsize != 0) {
        b->items = malloc((n ? n : 1) * sizeof *b->items);
        if (b->items == NULL)
            return SS_ENOMEM;
    }
    for (size_t j = 0; j < njobs; j++) {
        uint64_t len = job_len(b, j);
        int dev = job_dev(b, j);
        size_t ps = dev ? dsize : psize;
        (*first)[j] = k;
        for (uint64_t s = 0; s < len; s += ps, k++) {
            uint64_t l = len - s < ps ? len - s : ps;
            b->pieces[k] = (piece){j, s, l, 1, SIZE_MAX};
            if (dev && b->w != NULL) {
                b->items[items] =
                    (ss_stage_item){(const char *)b->w[j].src + s, (size_t)l};
                b->pieces[k].item = items++;
            }
        }
    }
    b->nitems = items;
    (*first)[njobs] = k;
    if (b->r != NULL)
        coalesce(b, k, psize);
    return 0;
}

static int run_batch(const ss_os *os, ss_pool *pool, const char *const *paths,
                     size_t npaths, const ss_io_wjob *w, const ss_io_rjob *r,
                     size_t njobs, const ss_io_opts *opts, uint32_t *crcs,
                     ss_errinfo *err)
{
    const ss_io_opts defaults = SS_IO_OPTS_INIT;
    size_t psize, *first = NULL;
    int rc = 0, staged = 0;
    batch b = {0};

    if (opts == NULL)
        opts = &defaults;
    b.os = os != NULL ? os : ss_os_default();
    b.paths = paths;
    b.w = w;
    b.r = r;
    atomic_init(&b.failed, 0);
    pthread_mutex_init(&b.mu, NULL);
    ss_errinfo_clear(&b.first);
    if (opts->size < sizeof *opts) { /* not initialised with the macro */
        record(&b, SS_EINVAL, "options", NULL, -1, -1);
        snprintf(b.first.detail, sizeof b.first.detail,
                 "ss_io_opts.size is %zu, expected %zu", opts->size,
                 sizeof *opts);
        goto out;
    }
    psize = opts->piece ? opts->piece : SS_IO_PIECE_DEFAULT;
    b.checksum = opts->checksum;
    b.writeback = opts->writeback;
    b.patch = opts->patch;
    b.verify = opts->verify;
    b.psize = psize;
    if (r != NULL) {
        b.capspare = (size_t)ss_pool_threads(pool) + 1;
        b.spare = malloc(b.capspare * sizeof *b.spare);
        if (b.spare == NULL) {
            record(&b, SS_ENOMEM, "malloc", NULL, -1, -1);
            goto out;
        }
    }

    b.fds = malloc((npaths ? npaths : 1) * sizeof *b.fds);
    if (b.fds == NULL) {
        record(&b, SS_ENOMEM, "malloc", NULL, -1, -1);
        goto out;
    }
    for (size_t f = 0; f < npaths; f++)
        b.fds[f] = -1;
    for (size_t j = 0; j < njobs && opts->stage != NULL; j++)
        staged |= job_dev(&b, j);
    /* a device piece fits one staging buffer */
    b.dsize = opts->stage != NULL ? ss_stage_bufsize(opts->stage) : 0;
    if (validate(&b, npaths, njobs) < 0)
        goto out;
    if (make_pieces(&b, njobs, psize, &first) < 0) {
        record(&b, SS_ENOMEM, "malloc", NULL, -1, -1);
        goto out;
    }
    if (open_files(&b, npaths, njobs) < 0)
        goto out;
    if (staged) {
        rc = w != NULL ? ss__stage_begin_d2h(opts->stage, b.items, b.nitems,
                                             opts->stream)
                       : ss__stage_begin_h2d(opts->stage);
        if (rc < 0) {
            record(&b, rc, "device copy", NULL, -1, -1);
            goto out;
        }
        b.stage = opts->stage; /* from here on, failures cancel the stage */
    }
    ss_pool_run(pool, first[njobs], piece_task, &b);
    if (b.stage != NULL) {
        /* every copy is done before the batch returns */
        rc = ss__stage_end(b.stage);
        b.stage = NULL;
        if (rc < 0)
            record(&b, rc, "device copy", NULL, -1, -1);
    }
    if (b.first.code == SS_EDEVICE && b.first.detail[0] == '\0')
        ss_stage_describe(opts->stage, b.first.detail, sizeof b.first.detail);
    if (w != NULL && opts->fsync)
        ss_pool_run(pool, npaths, fsync_task, &b);

out:
    for (size_t f = 0; b.fds != NULL && f < npaths; f++) {
        if (b.fds[f] >= 0) {
            int c = b.os->close(b.os, b.fds[f]);
            if (c < 0 && c != -EINTR) /* after EINTR the fd is closed too */
                record(&b, c, "close", paths[f], -1, -1);
        }
    }
    rc = b.first.code;
    for (size_t j = 0; rc == 0 && j < njobs; j++) {
        uint32_t crc = 0;
        for (size_t i = first[j]; wants_crc(&b, j) && i < first[j + 1]; i++)
            crc = i == first[j]
                      ? b.piece_crc[i]
                      : ss_crc32_combine(crc, b.piece_crc[i], b.pieces[i].len);
        if (crcs != NULL)
            crcs[j] = crc;
        if (r != NULL && opts->verify && r[j].has_crc && crc != r[j].crc) {
            record(&b, SS_ECHECKSUM, "verify", paths[r[j].file], r[j].offset,
                   (int64_t)j);
            snprintf(b.first.detail, sizeof b.first.detail,
                     "expected crc32 0x%08x, read 0x%08x over %llu bytes",
                     (unsigned)r[j].crc, (unsigned)crc,
                     (unsigned long long)r[j].len);
            rc = SS_ECHECKSUM;
        }
    }
    if (err != NULL)
        ss_errinfo_copy(err, &b.first);
    pthread_mutex_destroy(&b.mu);
    free(b.fds);
    free(b.pieces);
    free(b.piece_crc);
    free(b.items);
    for (size_t k = 0; k < b.nspare; k++)
        free(b.spare[k]);
    free(b.spare);
    free(first);
    return rc;
}

int ss_io_write(const ss_os *os, ss_pool *pool, const char *const *paths,
                size_t npaths, const ss_io_wjob *jobs, size_t njobs,
                const ss_io_opts *opts, uint32_t *crcs, ss_errinfo *err)
{
    static const ss_io_wjob none;
    return run_batch(os, pool, paths, npaths, jobs != NULL ? jobs : &none, NULL,
                     njobs, opts, crcs, err);
}

int ss_io_read(const ss_os *os, ss_pool *pool, const char *const *paths,
               size_t npaths, const ss_io_rjob *jobs, size_t njobs,
               const ss_io_opts *opts, uint32_t *crcs, ss_errinfo *err)
{
    static const ss_io_rjob none;
    return run_batch(os, pool, paths, npaths, NULL, jobs != NULL ? jobs : &none,
                     njobs, opts, crcs, err);
}

/* ---- baselines ---------------------------------------------------------- */

int ss_io_raw_pwrite(const char *path, const void *buf, size_t len,
                     size_t piece)
{
    int rc = 0, fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    size_t done = 0;

    if (fd < 0)
        return -errno;
    if (piece == 0)
        piece = SS_IO_PIECE_DEFAULT;
    while (done < len) {
        size_t n = len - done < piece ? len - done : piece;
        ssize_t k = pwrite(fd, (const char *)buf + done, n, (off_t)done);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            rc = k < 0 ? -errno : -EIO;
            break;
        }
        done += (size_t)k;
    }
    if (close(fd) < 0 && rc == 0)
        rc = -errno;
    return rc;
}

int ss_io_raw_pread(const char *path, void *buf, size_t len, size_t piece)
{
    int rc = 0, fd = open(path, O_RDONLY | O_CLOEXEC);
    size_t done = 0;

    if (fd < 0)
        return -errno;
    if (piece == 0)
        piece = SS_IO_PIECE_DEFAULT;
    while (done < len) {
        size_t n = len - done < piece ? len - done : piece;
        ssize_t k = pread(fd, (char *)buf + done, n, (off_t)done);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            rc = k < 0 ? -errno : SS_ESHORT;
            break;
        }
        done += (size_t)k;
    }
    close(fd);
    return rc;
}
