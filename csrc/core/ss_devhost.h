/* ss_devhost.h - an ss_dev backend on plain host memory, for tests and
 * for machines without a GPU.
 *
 * "Device" pointers are host pointers. Each stream is a thread that runs
 * its queued copies in order, so copies really are asynchronous: the
 * staging pipeline's ordering (a buffer is not reused before its copy is
 * done, a consumer waits for its copy) is exercised as with CUDA. Tests
 * can slow every copy down and make a chosen copy fail when it is issued.
 *
 * Thread safety: the vtable may be used from any number of threads; the
 * test knobs may be set while no batch runs.
 */
#ifndef SS_DEVHOST_H
#define SS_DEVHOST_H

#include "ss_dev.h"

typedef struct ss_devhost ss_devhost;

int ss_devhost_new(ss_devhost **out);
void ss_devhost_free(ss_devhost *h); /* NULL is a no-op */
const ss_dev *ss_devhost_dev(ss_devhost *h);

/* Every copy sleeps this long before it moves bytes (0: none). */
void ss_devhost_set_delay(ss_devhost *h, unsigned microseconds);
/* Copy call number k (1-based, counted from now) fails with code when it
 * is issued; k = 0 disarms. */
void ss_devhost_fail_copy(ss_devhost *h, long k, int code);
/* Copies issued and copies completed so far. */
long ss_devhost_issued(ss_devhost *h);
long ss_devhost_completed(ss_devhost *h);
/* Most copies that were queued and not yet done at one time. */
long ss_devhost_max_inflight(ss_devhost *h);

#endif /* SS_DEVHOST_H */
