/* ss_stage.h - the staging pipeline between device memory and files: a
 * bounded pool of page-locked host buffers, one dedicated copy stream and
 * an event per buffer, on an ss_dev backend.
 *
 * ss_io uses a stage for the jobs of a batch whose buffers are device
 * memory (ss_io_opts.stage). On a write, device-to-host copies into free
 * buffers are queued in the order the pieces will be written, as far
 * ahead as free buffers allow, after everything the caller queued on its
 * stream (ss_io_opts.stream); a writer waits only for its own piece's
 * copy, so the copy of piece k+1 runs while piece k is written, and each
 * buffer goes back to the pool once its piece is on its way to disk. On a
 * read, a piece is read into a free buffer, and a host-to-device copy
 * from it is queued; the buffer is reused once that copy is done. A batch
 * returns only after all its copies are done.
 *
 * The pool is made once (ss_stage_new) and kept across batches, so pinned
 * memory is allocated once: nbufs * bufsize bytes in all.
 *
 * Thread safety: batches on one stage take turns (a second one begins
 * when the first has ended; a thread must not begin a batch while it runs
 * one); within a batch the ss__stage_* calls may come from any number of
 * threads.
 */
#ifndef SS_STAGE_H
#define SS_STAGE_H

#include <stddef.h>

#include "ss_dev.h"

typedef struct ss_stage ss_stage;

/* nbufs >= 1 buffers of bufsize >= 4096 bytes each. */
int ss_stage_new(ss_stage **out, const ss_dev *dev, size_t nbufs,
                 size_t bufsize);
void ss_stage_free(ss_stage *st); /* NULL is a no-op; not during a batch */
size_t ss_stage_bufsize(const ss_stage *st);
size_t ss_stage_nbufs(const ss_stage *st);
/* The backend's text for its last failure (SS_EDEVICE), or "". */
void ss_stage_describe(const ss_stage *st, char *buf, size_t len);

/* ---- the batch protocol (for ss_io) ---- */

/* One device source of a write, in the order the pieces are consumed. */
typedef struct ss_stage_item {
    const void *dev;
    size_t len; /* <= bufsize */
} ss_stage_item;

/* Start a write batch over items (kept until ss__stage_end), ordered
 * after the caller's stream. On failure there is no batch to end. */
int ss__stage_begin_d2h(ss_stage *st, const ss_stage_item *items, size_t n,
                        void *caller_stream);
/* Wait for item k's copy; *host then holds its bytes until ss__stage_give.
 * Items must be taken in increasing order by the threads as a whole (the
 * thread pool hands its tasks out that way): an item waits for the copies
 * of all the items before it to have a buffer. */
int ss__stage_take(ss_stage *st, size_t k, const void **host);
void ss__stage_give(ss_stage *st, size_t k);

/* Start a read batch (after the running one, if any, has ended). */
int ss__stage_begin_h2d(ss_stage *st);
/* A free buffer (its last copy done) in *host, its slot in *slot. */
int ss__stage_buffer(ss_stage *st, void **host, size_t *slot);
/* Queue the copy of len bytes from the slot's buffer to dev; the slot is
 * free again once that copy is done. On failure the slot is free too. */
int ss__stage_h2d(ss_stage *st, size_t slot, void *dev, size_t len);
/* Give a slot back without a copy (its read failed). */
void ss__stage_put(ss_stage *st, size_t slot);

/* Another part of the batch failed: waiting and later calls return
 * SS_ECANCELED (or the copy error that caused it). */
void ss__stage_cancel(ss_stage *st);
/* Wait until every copy queued is done and end the batch. 0 or the first
 * error of a copy or a wait. */
int ss__stage_end(ss_stage *st);

#endif /* SS_STAGE_H */
