/* ss_recmem.h - an ss_os whose files are caller memory buffers.
 *
 * The batch engine (ss_io.h, ss_recwrite.h) reaches files only through an
 * ss_os vtable; this one makes file k of a batch the caller's buffer k, so
 * the same engine frames records and computes their CRCs straight into
 * memory (a window of an upload, an in-memory filesystem's object) instead
 * of into a file: no file, no page cache, no second copy.
 *
 * Paths are "mem:<k>" (decimal, k < n); any other path is ENOENT. Files
 * have the size of their buffer and never change size: a write past the
 * end is EFBIG and ftruncate to more than the buffer's size is EFBIG (to
 * less, a no-op: O_TRUNC and ftruncate do not clear or shrink anything,
 * so bytes no job writes keep the buffer's content). pread/preadv read
 * the buffer; fsync, writeback and close do nothing; rename, unlink,
 * fsync_dir, mkdir and mmap are ENOTSUP.
 *
 * Thread safety: the vtable only reads its table; jobs write disjoint
 * ranges (an ss_io rule), so any number of threads may use it at once.
 * The caller keeps the buffers alive and unmoved while it is in use.
 */
#ifndef SS_RECMEM_H
#define SS_RECMEM_H

#include <stddef.h>
#include <stdint.h>

#include "ss_os.h"

typedef struct ss_memfile {
    uint8_t *base;
    uint64_t size;
} ss_memfile;

typedef struct ss_memos {
    ss_os os; /* first: the vtable handed to the engine */
    const ss_memfile *files;
    size_t n;
} ss_memos;

/* Sets m up over files[0..n) (kept, not copied). */
void ss_memos_init(ss_memos *m, const ss_memfile *files, size_t n);

/* The vtable (valid while m and files are). */
static inline const ss_os *ss_memos_os(const ss_memos *m)
{
    return &m->os;
}

#endif /* SS_RECMEM_H */
