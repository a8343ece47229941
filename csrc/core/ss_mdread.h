/* ss_mdread.h - decode a checkpoint's .metadata pickle into a flat table.
 *
 * The fast path of the restricted reader (python/shardstate/checkpoint/
 * _pickle/, csrc/py/mdread.c): the opcodes of a .metadata stream are run
 * into a table of nodes, without the GIL and without making any Python
 * object; the binding then turns the table into the metadata classes in
 * one pass. Only the opcodes torch's pickle of a Metadata uses (protocols
 * 3-5: strings, bytes, ints, floats, None and bools, tuples, lists, dicts,
 * GLOBAL/STACK_GLOBAL, NEWOBJ, REDUCE, BUILD, the memo, FRAME) are
 * decoded; any other stream is refused, and the caller falls back to the
 * reference path, which decides (so a refusal is never an error of the
 * file).
 *
 * Invariants of an accepted stream (the bounds of ss_pickle_scan, checked
 * here again, tighter; nesting is left to the walk that reads the table,
 * which must bound its own depth):
 *  - every length and argument lies inside the data; every memo index put
 *    is at most the number of entries stored (picklers number them 0, 1,
 *    2, ...), every index got was stored; no DUP;
 *  - PROTO 3..5 first; no opcode crosses the end of its FRAME; the stream
 *    ends with STOP on a stack of exactly one value and no open MARK;
 *    nothing is popped unused (no POP), so every node is reachable from
 *    the root (the binding checks every node it walks, hence all of them);
 *  - ints fit in int64; strings and bytes are (offset, length) in the data,
 *    not decoded (the binding decodes them as the C unpickler does);
 *  - STACK_GLOBAL's operands are string nodes; NEWOBJ's and REDUCE's
 *    arguments are tuple nodes; BUILD applies at most once, and only to a
 *    NEWOBJ or REDUCE node; APPEND(S) only to lists, SETITEM(S) only to
 *    dicts (an even number of items);
 *  - a node fetched from the memo (GET) carries a share slot (1-based,
 *    dense, at most SS_MD_SHARE_MAX), so the binding can build it once; no
 * other node is reachable twice, but for the immutable ones decode makes once
 * and hands out for every use (None, the bools, ints 0..65535, the empty
 * tuple).
 *
 * The result is immutable after decode and may be read from any thread;
 * decode itself keeps no state beyond its arguments. */
#ifndef SS_MDREAD_H
#define SS_MDREAD_H

#include <stddef.h>
#include <stdint.h>

#include "ss_error.h"

enum ss_md_kind {
    SS_MD_NONE = 0,
    SS_MD_FALSE,
    SS_MD_TRUE,
    SS_MD_INT,    /* a | b << 32: the int64 value */
    SS_MD_FLOAT,  /* a | b << 32: the IEEE-754 bits */
    SS_MD_STR,    /* a: offset in the data, b: length (UTF-8 bytes) */
    SS_MD_BYTES,  /* a: offset, b: length */
    SS_MD_TUPLE,  /* a: offset in kids, b: count */
    SS_MD_LIST,   /* a: offset in kids, b: count */
    SS_MD_DICT,   /* a: offset in kids, b: pairs (key, value, key, ...) */
    SS_MD_GLOBAL, /* a: module node, b: name node (both SS_MD_STR) */
    SS_MD_NEWOBJ, /* a: class node, b: args (a tuple), c: state + 1 or 0 */
    SS_MD_REDUCE  /* a: callable node, b: args (a tuple), c: state + 1 or 0 */
};

/* 16 bytes: a .metadata of 192,000 chunks makes about 4 million. */
typedef struct ss_md_node {
    unsigned kind : 8;   /* enum ss_md_kind */
    unsigned share : 24; /* 0, or the node's share slot (fetched from memo) */
    uint32_t a, b, c;
} ss_md_node;

/* The most share slots a stream may use (decode refuses more). */
#define SS_MD_SHARE_MAX 0xffffffu

/* A kid with this bit is no node but row (kid & ~SS_MD_ROW_BIT) of a fold
 * hook (below); node indices stay below it. Decode without a hook makes
 * none. */
#define SS_MD_ROW_BIT 0x80000000u

/* A list's or dict's c, while decoding only: its items, filled in one
 * batch, are kids[a, a + count) (count: b, or 2b for a dict). c == 0: no
 * items yet; any other c: filled in several batches (not contiguous yet). */
#define SS_MD_ONE_RUN UINT32_MAX

typedef struct ss_md_result {
    const ss_md_node *nodes;
    size_t nnodes;
    const uint32_t *kids; /* children of tuples, lists and dicts */
    size_t nkids;
    uint32_t root;   /* the value STOP returned */
    uint32_t shared; /* share slots handed out (1..shared) */
    int proto;       /* the stream's protocol */
} ss_md_result;

typedef struct ss_mdread ss_mdread;

/* The streaming hook (issue 16): a large .metadata repeats one small form
 * per chunk (a ChunkStorageMetadata, a storage entry), a dozen nodes of
 * 16 bytes where the file holds tens of bytes; a hook that turns each into
 * a row of its own arrays as soon as it is complete keeps the table small.
 *
 * batch is called when APPENDS or SETITEMS adds the n items at items (a
 * list's values, or n / 2 (key, value) pairs of a dict) to container ci,
 * and every node made since that batch's MARK is reachable only from them:
 * no GET names any of them later (the memo's prescan), and no node older
 * than the MARK changed since (BUILD, items added). t is the table so far
 * (nodes [0, nnodes), kids [0, nkids), containers as SS_MD_ONE_RUN says).
 * It returns 0 (not taken: the items stay nodes), a negative SS_E* code
 * (decode fails with it), or 1: it made one row of each item (pair), with
 * ids *row0, *row0 + 1, ... (all below SS_MD_ROW_BIT); the decoder then
 * drops every node made since the MARK (their indices are reused) and adds
 * the row ids (| SS_MD_ROW_BIT) as ci's items (a pair's twice: key, value).
 * Runs on the decoding thread; t is valid during the call only. */
typedef struct ss_md_fold {
    int (*batch)(void *ctx, const ss_md_result *t, uint32_t ci,
                 const uint32_t *items, size_t n, uint32_t *row0);
    void *ctx;
} ss_md_fold;

/* Decode data[0, len) (len < 2^32). 0 with *out set (free it with
 * ss_mdread_free), or SS_EINVAL (a stream outside the decoded set, see
 * above), SS_ERANGE (a length, frame or memo index out of bounds, no STOP)
 * or SS_ENOMEM,
 * with err (may be NULL) naming the offset. The data must outlive *out. */
int ss_mdread_decode(const void *data, size_t len, ss_mdread **out,
                     ss_errinfo *err);

/* ss_mdread_decode with a fold hook (NULL: none); kids may then carry
 * SS_MD_ROW_BIT, and every node is still reachable from the root. */
int ss_mdread_decode_fold(const void *data, size_t len, const ss_md_fold *fold,
                          ss_mdread **out, ss_errinfo *err);

/* The decoded table; valid until ss_mdread_free. */
const ss_md_result *ss_mdread_result(const ss_mdread *r);

/* Frees everything decode allocated; NULL is a no-op. */
void ss_mdread_free(ss_mdread *r);

#endif /* SS_MDREAD_H */
