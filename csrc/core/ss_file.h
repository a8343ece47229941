/* ss_file.h - single-file operations of a save and a load, through the OS
 * vtable: atomic publish, whole-file read, size, read-only map, unlink,
 * directory fsync and mkdir -p.
 *
 * Everything a checkpoint does to a file besides the batch engine's reads
 * and writes goes through here, so one fault injector (ss_os.h) reaches
 * every call of a save and of a load. Files that are read are opened with
 * O_NONBLOCK (a FIFO does not wait for a writer) and refused with
 * SS_ENOTREG unless they are regular files. Each function returns 0 (or
 * the documented value) or a negative code detailed in *err (may be NULL);
 * none leaks a descriptor or memory on any path. os NULL = ss_os_default().
 * Thread safety: none keeps state; any number may run at once.
 */
#ifndef SS_FILE_H
#define SS_FILE_H

#include <stddef.h>
#include <stdint.h>

#include "ss_error.h"
#include "ss_os.h"

/* Replace path with data atomically: write a uniquely named temp file in
 * the same directory, fsync it (if durable), close, rename over path, then
 * fsync the directory (if durable). On any failure before the rename the
 * temp file is removed and an existing file at path is untouched; if only
 * the directory fsync fails, the new content is in place but its
 * durability is not guaranteed, and the error is returned. */
int ss_file_publish(const ss_os *os, const char *path, const void *data,
                    size_t len, int durable, ss_errinfo *err);

/* The whole regular file at path, 1..max bytes, in a malloc'd buffer
 * (*out, the caller frees it) of *len bytes. SS_ERANGE when it is empty or
 * larger than max, SS_ESHORT when its size changes while it is read. */
int ss_file_read(const ss_os *os, const char *path, uint64_t max, void **out,
                 uint64_t *len, ss_errinfo *err);

/* The size of the regular file at path (opened, fstat, closed). */
int ss_file_size(const ss_os *os, const char *path, int64_t *size,
                 ss_errinfo *err);

/* The regular file at path mapped read-only and shared: *addr (NULL for
 * an empty file) and *size. Release with ss_file_unmap. A file truncated
 * while mapped faults on access (SIGBUS): map only files of this save or
 * load. */
int ss_file_map(const ss_os *os, const char *path, void **addr, int64_t *size,
                ss_errinfo *err);
void ss_file_unmap(const ss_os *os, void *addr, int64_t size);

/* Remove path. A missing file returns 0 when missing_ok (else -ENOENT);
 * a removed one returns 1. */
int ss_file_unlink(const ss_os *os, const char *path, int missing_ok,
                   ss_errinfo *err);

/* fsync the directory dir (makes renames and removals in it durable). */
int ss_file_fsync_dir(const ss_os *os, const char *dir, ss_errinfo *err);

/* mkdir -p: path and its missing parents, mode 0777 less the umask. An
 * existing directory is fine; an existing non-directory is -EEXIST. */
int ss_file_mkdirs(const ss_os *os, const char *path, ss_errinfo *err);

#endif /* SS_FILE_H */
