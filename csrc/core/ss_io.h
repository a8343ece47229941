/* ss_io.h - parallel batch file I/O with per-job CRC-32.
 *
 * A batch is a table of file paths plus an array of jobs, each naming a
 * buffer, a length, a file (index into the table) and an offset in it.
 * Every file is opened once per batch and shared by the threads through
 * pwrite/pread. Jobs are split into pieces of opts->piece bytes; each piece
 * is one pool task, checksummed right next to its transfer (while the bytes
 * are hot in cache), and piece CRCs are combined into each job's CRC-32
 * (zlib's crc32 of the job's bytes). Jobs in one file must not overlap (on
 * reads, neither may their destination buffers).
 *
 * Writes open files with O_WRONLY|O_CREAT|O_TRUNC|O_CLOEXEC, mode 0666
 * (less the umask): existing content is discarded. Each file is then sized
 * with ftruncate to the end of its last job, so gaps read back as zeros.
 * Reads open O_RDONLY|O_CLOEXEC and check every job's offset + length
 * against the file's size first (SS_ERANGE); a file that shrinks during the
 * read gives SS_ESHORT.
 *
 * Errors: the batch returns the first failure any worker saw (op, path,
 * offset, job index and errno in *err); later pieces are skipped. All files
 * are closed on every path. A failed fsync fails the batch. After a failed
 * write batch, the files hold unspecified content.
 *
 * Device buffers: a job marked `dev` is moved between its device buffer and
 * the file through opts->stage (see ss_stage.h): its pieces are staged in
 * the stage's pinned buffers, with the copies pipelined with the file
 * transfers; CRCs are computed on the staged bytes. Device jobs are never
 * coalesced.
 *
 * All system calls go through an ss_os vtable (NULL = ss_os_default()), so
 * tests can inject faults. Thread safety: a batch uses only its own state;
 * any number may run at once (on one pool too). The core never prints.
 */
#ifndef SS_IO_H
#define SS_IO_H

#include <stddef.h>
#include <stdint.h>

#include "ss_error.h"
#include "ss_os.h"
#include "ss_pool.h"
#include "ss_stage.h"

#define SS_IO_PIECE_DEFAULT ((size_t)8 << 20)
/* Largest transfer asked of one pread/pwrite (Linux caps at ~2 GiB). */
#define SS_IO_MAX_XFER ((size_t)1 << 30)
/* Reads are coalesced: consecutive read jobs of one file, each at most
 * SS_IO_COALESCE_JOB bytes, in ascending order with gaps of at most
 * SS_IO_COALESCE_GAP bytes between them, are read by one preadv (the gap
 * bytes into a discard buffer), up to one piece's size and
 * SS_OS_MAX_IOV / 2 jobs a read. */
#define SS_IO_COALESCE_JOB ((size_t)256 << 10)
#define SS_IO_COALESCE_GAP ((size_t)4096)

typedef struct ss_io_opts {
    size_t size;  /* sizeof(ss_io_opts); smaller is SS_EINVAL */
    size_t piece; /* bytes per task; 0 = SS_IO_PIECE_DEFAULT */
    int fsync;    /* write: fsync every file before closing it */
    int checksum; /* compute every job's CRC (else reported as 0) */
    int verify;   /* read: compute and compare the CRC of jobs with has_crc */
    /* write: start writeback of each piece as soon as it is written, so a
     * later fsync (here or the caller's) finds little left to do; a file
     * system without the call ignores it */
    int writeback;
    /* Jobs with `dev` set have their buffer in device memory and move
     * through this staging pipeline (pieces of at most its buffer size);
     * writes are ordered after `stream`, the caller's (NULL: default). */
    ss_stage *stage;
    void *stream;
    /* write: patch existing files in place: open them O_WRONLY without
     * O_CREAT/O_TRUNC and keep their size (a missing file is ENOENT). A file
     * in the table with no job is then only opened (and fsynced, with
     * fsync) and closed. */
    int patch;
} ss_io_opts;

#define SS_IO_OPTS_INIT                                                        \
    {sizeof(ss_io_opts), SS_IO_PIECE_DEFAULT, 0, 1, 1, 0, NULL, NULL, 0}

typedef struct ss_io_wjob {
    const void *src;
    uint64_t len;
    uint32_t file;  /* index into paths */
    int64_t offset; /* >= 0 */
    int dev;        /* src is device memory (needs opts->stage) */
} ss_io_wjob;

typedef struct ss_io_rjob {
    void *dst;
    uint64_t len;
    uint32_t file;
    int64_t offset;
    uint32_t crc; /* expected CRC-32, used when has_crc and opts->verify */
    int has_crc;
    int dev; /* dst is device memory (needs opts->stage) */
    /* Read for the CRC only: dst is NULL and the bytes land in engine
     * scratch (one piece-sized buffer per running task, reused; see
     * ss_io_read_recs). Coalesced like any job; not with dev. */
    int discard;
} ss_io_rjob;

/* Write every job; crcs (njobs entries, may be NULL) receives each job's
 * CRC-32 (0 when opts->checksum is off). opts NULL = defaults. Returns 0 or
 * the first error, detailed in *err (may be NULL). */
int ss_io_write(const ss_os *os, ss_pool *pool, const char *const *paths,
                size_t npaths, const ss_io_wjob *jobs, size_t njobs,
                const ss_io_opts *opts, uint32_t *crcs, ss_errinfo *err);

/* Read every job into its buffer; crcs (may be NULL) receives each job's
 * CRC-32 of the bytes read, computed when opts->checksum is on or the job is
 * verified (else 0). A verified mismatch is SS_ECHECKSUM, with the job's
 * path and offset in *err. */
int ss_io_read(const ss_os *os, ss_pool *pool, const char *const *paths,
               size_t npaths, const ss_io_rjob *jobs, size_t njobs,
               const ss_io_opts *opts, uint32_t *crcs, ss_errinfo *err);

/* The core's transfer loops: all of len bytes at off, retrying EINTR and
 * continuing after short transfers (at most SS_IO_MAX_XFER a call). On
 * failure *at is the offset that failed; a write making no progress is
 * -EIO, a read reaching end of file first SS_ESHORT. */
int ss_io_write_all(const ss_os *os, int fd, const void *buf, uint64_t len,
                    int64_t off, int64_t *at);
int ss_io_read_all(const ss_os *os, int fd, void *buf, uint64_t len,
                   int64_t off, int64_t *at);

/* Benchmark baselines: one thread, a plain pwrite/pread loop of piece-size
 * calls (0 = SS_IO_PIECE_DEFAULT), no checksum, direct syscalls. The write
 * creates/truncates path; the read needs len bytes in the file. */
int ss_io_raw_pwrite(const char *path, const void *buf, size_t len,
                     size_t piece);
int ss_io_raw_pread(const char *path, void *buf, size_t len, size_t piece);

#endif /* SS_IO_H */
