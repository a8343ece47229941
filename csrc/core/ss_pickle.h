/* ss_pickle.h - a bounds-checking scan of a pickle's opcode stream.
 *
 * The restricted unpickler (python/shardstate/checkpoint/_pickle/
 * unpickler.py) runs CPython's C unpickler, which is about ten times faster
 * than its pure-Python one, only on a stream this scan has passed. The scan
 * proves, before any object is made, the properties the C unpickler does not
 * check and the pure-Python path relies on:
 *
 *  - every opcode is one of protocols 0-5 outside this refused set:
 *    PERSID, BINPERSID (persistent ids), EXT1, EXT2, EXT4 (the copyreg
 *    extension cache can hand out objects without find_class), NEXT_BUFFER,
 *    READONLY_BUFFER (out-of-band buffers), and the text numbers INT, LONG,
 *    FLOAT, GET (protocol 0 only), which the two unpicklers parse
 *    differently (C strings up to a NUL, LONG in base 10);
 *  - every argument lies inside the data: lengths, frames, text lines;
 *  - every opcode that starts inside a FRAME ends inside it, and no FRAME
 *    starts inside another: the C unpickler holds a frame as one buffer
 *    and, for a read that runs past its end, drops the rest of it and
 *    reads on from the file, so it would run other opcodes than the ones
 *    scanned (bytes the scan took for a string's data: a forged memo
 *    index, a tuple nested 300000 deep);
 *  - PROTO, if present, is the first opcode (so one protocol governs every
 *    GLOBAL's name mapping), with a version of at most 5;
 *  - every memo index stored (PUT, BINPUT, LONG_BINPUT) is at most the
 *    number of memo entries stored before it (picklers number them 0, 1,
 *    2, ...): the C unpickler's memo is an array sized by the largest
 *    index, so a forged index could otherwise make it allocate gigabytes;
 *    with this bound it stays linear in the data; every GET names a
 *    stored entry;
 *  - on a model of the stack (each value its nesting depth), no value
 *    nests deeper than SS_PICKLE_DEPTH_MAX containers as it is built:
 *    hashing a deeper tuple (a dict key, a set member) would overflow the
 *    C stack, tuple hashing has no recursion guard; every opcode finds
 *    the operands it takes (no underflow);
 *  - DUP, which no pickler writes, adds at most as many values as the
 *    other bytes of the stream, plus SS_PICKLE_DUP_SLACK: so every value
 *    the unpickler builds is paid for by a byte of the stream;
 *  - the stream ends with STOP (bytes after the first STOP are not read).
 *
 * A stream that fails the scan is not necessarily malformed: the caller
 * runs the pure-Python reference unpickler on it, which decides. The scan
 * reads only [data, data + len); it allocates its stack model (4 bytes a
 * value, at most a few times len) and frees it before it returns; no
 * state, thread-safe.
 */
#ifndef SS_PICKLE_H
#define SS_PICKLE_H

#include <stddef.h>
#include <stdint.h>

#include "ss_error.h"

/* The deepest nesting admitted (torch's .metadata nests about 10 deep; the
 * restricted reader builds nothing deeper than 100). The Python reference
 * unpickler (unpickler.py, _MAX_NEST) refuses at the same depth. */
#define SS_PICKLE_DEPTH_MAX 1000
/* DUPs admitted beyond the stream's other bytes. */
#define SS_PICKLE_DUP_SLACK 65536

typedef struct ss_pickle_info {
    int proto;      /* the leading PROTO's version, else 0 */
    size_t opcodes; /* opcodes up to and including STOP */
    size_t end;     /* offset just past STOP */
} ss_pickle_info;

/* 0 when the stream passes (info filled); else SS_EINVAL (an opcode outside
 * the admitted set, PROTO out of place, a stack underflow), SS_ERANGE (an
 * argument, frame or memo index out of bounds, an opcode across a frame's
 * end; nesting or DUPs past their bounds; a missing STOP) or SS_ENOMEM,
 * with err's offset at the opcode and its detail naming it. info and err
 * may be NULL. */
int ss_pickle_scan(const void *data, size_t len, ss_pickle_info *info,
                   ss_errinfo *err);

#endif /* SS_PICKLE_H */
