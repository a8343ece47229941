/* ss_copy.h - bulk memory copy for large, write-once destinations.
 *
 * ss_copy(dst, src, n) is memcpy (no overlap allowed) tuned for the copies
 * this library makes: staging a state dict into host arenas, moving read
 * data into tensors, flattening optimizer state. Their destinations are
 * large and are not read again soon, so from SS_COPY_STREAM_MIN bytes on
 * (x86-64) the copy stores with non-temporal stores: no read-for-ownership
 * of the destination lines and no eviction of the caller's working set.
 * Loads walk four pages at once, which keeps more DRAM rows open than one
 * sequential stream. glibc's memcpy does this only above a threshold of a
 * good part of the last-level cache (hundreds of MiB here), far above the
 * pieces a copy is split into for the thread pool. Below the threshold, or
 * elsewhere than x86-64, it is plain memcpy.
 *
 * The stores are fenced before return, so the bytes are visible to another
 * thread that synchronises with this one afterwards, as with memcpy.
 * Thread-safe; no state.
 */
#ifndef SS_COPY_H
#define SS_COPY_H

#include <stddef.h>

/* Copies from this size on stream past the caches (x86-64). */
#define SS_COPY_STREAM_MIN ((size_t)256 * 1024)

void ss_copy(void *dst, const void *src, size_t n);

#endif /* SS_COPY_H */
