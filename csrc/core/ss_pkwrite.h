/* ss_pkwrite.h - a protocol-4 pickle emitter that writes the bytes
 * CPython's C pickler (Modules/_pickle.c) writes for the same opcodes.
 *
 * The caller decides the opcodes (which object is saved where, which is
 * memoized); this module gets every byte-level rule right:
 *
 *  - FRAME framing as _Pickler_Write / _Pickler_OpcodeBoundary /
 *    _Pickler_CommitFrame do it: PROTO 4 outside any frame; a frame opens
 *    at the first write after a commit (9 header bytes reserved); at each
 *    save() boundary (ss_pkw_boundary: the caller calls it where the
 *    pickler enters save()) a frame of >= SS_PKW_FRAME_TARGET bytes is
 *    committed; a frame of < 4 bytes loses its header; a str or bytes
 *    payload of >= SS_PKW_FRAME_TARGET bytes commits the open frame and is
 *    written outside any frame;
 *  - the short and long forms: BININT1/BININT2/BININT, LONG1 (minimal
 *    two's complement), BINFLOAT (big-endian), SHORT_BINUNICODE /
 *    BINUNICODE / BINUNICODE8, SHORT_BINBYTES / BINBYTES / BINBYTES8,
 *    MEMOIZE (the memo counter), BINGET / LONG_BINGET.
 *
 * ss_pkmemo is the identity map such a caller needs: an open-addressing
 * table from a nonzero key (an address) to a 32-bit value.
 *
 * Errors: every function returns 0 or a negative SS_E* code (SS_ENOMEM,
 * SS_ERANGE for lengths no opcode can carry); the writer's first error is
 * sticky (later calls return it and write nothing) and its detail is in
 * w->err. Neither type is thread-safe; distinct instances are independent.
 */
#ifndef SS_PKWRITE_H
#define SS_PKWRITE_H

#include <stddef.h>
#include <stdint.h>

#include "ss_error.h"

/* CPython's FRAME_SIZE_TARGET and FRAME_HEADER_SIZE. */
#define SS_PKW_FRAME_TARGET (64 * 1024)
#define SS_PKW_FRAME_HEADER 9
/* The pickler's batch size for APPENDS / SETITEMS. */
#define SS_PKW_BATCH 1000

/* Opcodes used by writers of protocol 4. */
enum {
    SS_PK_MARK = '(',
    SS_PK_STOP = '.',
    SS_PK_NONE = 'N',
    SS_PK_REDUCE = 'R',
    SS_PK_APPEND = 'a',
    SS_PK_APPENDS = 'e',
    SS_PK_BUILD = 'b',
    SS_PK_EMPTY_DICT = '}',
    SS_PK_EMPTY_LIST = ']',
    SS_PK_EMPTY_TUPLE = ')',
    SS_PK_SETITEM = 's',
    SS_PK_SETITEMS = 'u',
    SS_PK_TUPLE = 't',
    SS_PK_TUPLE1 = 0x85,
    SS_PK_TUPLE2 = 0x86,
    SS_PK_TUPLE3 = 0x87,
    SS_PK_NEWOBJ = 0x81,
    SS_PK_NEWTRUE = 0x88,
    SS_PK_NEWFALSE = 0x89,
    SS_PK_STACK_GLOBAL = 0x93,
};

typedef struct ss_pkw {
    /* private: read only through the functions below */
    unsigned char *buf;
    size_t len, cap;
    size_t frame_start; /* SIZE_MAX: no frame open */
    int framing;
    int rc;          /* first error, sticky */
    uint64_t memo_n; /* MEMOIZEs written */
    ss_errinfo err;
} ss_pkw;

/* An empty writer (cap_hint: bytes to reserve, may be 0). */
int ss_pkw_init(ss_pkw *w, size_t cap_hint);
/* Frees the buffer unless taken; w may be zeroed or NULL. */
void ss_pkw_destroy(ss_pkw *w);

/* PROTO 4; framing on. First call on a fresh writer. */
int ss_pkw_start(ss_pkw *w);
/* Where the pickler enters save(): commits a frame grown to the target. */
int ss_pkw_boundary(ss_pkw *w);
/* Raw bytes (inside the open frame, opening one when framing is on). */
int ss_pkw_raw(ss_pkw *w, const void *p, size_t n);
static inline int ss_pkw_op(ss_pkw *w, unsigned char op)
{
    if (w->rc == 0 && w->frame_start != SIZE_MAX && w->len < w->cap) {
        w->buf[w->len++] = op;
        return 0;
    }
    return ss_pkw_raw(w, &op, 1);
}
int ss_pkw_int(ss_pkw *w, int64_t v);
int ss_pkw_float(ss_pkw *w, double v);
/* A str (its UTF-8 bytes) or a bytes object; not memoized. */
int ss_pkw_str(ss_pkw *w, const char *utf8, size_t n);
int ss_pkw_bytes(ss_pkw *w, const void *p, size_t n);
/* MEMOIZE; *index (may be NULL) gets the entry's number. SS_ERANGE past
 * 2^32 entries (no LONG_BINGET could name them). */
int ss_pkw_memoize(ss_pkw *w, uint32_t *index);
/* BINGET or LONG_BINGET of an entry written before. */
int ss_pkw_get(ss_pkw *w, uint32_t index);
/* STOP, and the last frame committed. */
int ss_pkw_finish(ss_pkw *w);
/* The bytes written (valid until the next call or destroy). */
static inline const unsigned char *ss_pkw_data(const ss_pkw *w, size_t *len)
{
    *len = w->len;
    return w->buf;
}

typedef struct ss_pkmemo {
    /* private */
    uintptr_t *keys; /* 0: empty slot */
    uint32_t *vals;
    size_t mask; /* slots - 1; slots a power of two */
    size_t used;
} ss_pkmemo;

int ss_pkmemo_init(ss_pkmemo *m);
void ss_pkmemo_destroy(ss_pkmemo *m);
/* 1 and *val when key is present, else 0. key != 0. */
int ss_pkmemo_get(const ss_pkmemo *m, uintptr_t key, uint32_t *val);
/* Adds a key not present (asserted). 0 or SS_ENOMEM. */
int ss_pkmemo_put(ss_pkmemo *m, uintptr_t key, uint32_t val);
/* Iterates the keys: start with *pos = 0; 1 and *key while there is one. */
int ss_pkmemo_next(const ss_pkmemo *m, size_t *pos, uintptr_t *key);

#endif /* SS_PKWRITE_H */
