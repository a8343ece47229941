/* ss_pickle.c - the opcode scan of ss_pickle.h.
 *
 * One table gives each opcode's argument form (as Lib/pickletools.py
 * documents them); the scan steps over every opcode and its argument,
 * checking each length against the bytes left. Nothing is decoded but
 * lengths, the protocol and memo indices.
 *
 * Alongside, a model of the unpickler's stack (struct vm): each value is
 * only its nesting depth (0 for a scalar, 1 + its deepest element for a
 * container, as far as the stream has built it on the stack), the marks
 * are positions in it, the memo holds depths. It bounds what the C
 * unpickler would build: nesting (SS_PICKLE_DEPTH_MAX), memo indices (at
 * most the entries stored), DUP (SS_PICKLE_DUP_SLACK). Anything the model
 * cannot follow (a stack underflow) fails the scan, which sends the
 * stream to the reference unpickler. */
#include "ss_pickle.h"

#include <stdlib.h>
#include <string.h>

/* The model's arrays, grown by doubling; 4 bytes a value. */
typedef struct vm {
    uint32_t *stack;
    size_t sp, scap;
    size_t *marks;
    size_t nmarks, mcap;
    uint32_t *memo; /* depth + 1 per index; 0: not stored */
    size_t mlen, memo_cap, filled;
    size_t dups;
} vm;

static int grow(void **a, size_t *cap, size_t need, size_t elem)
{
    size_t n = *cap ? *cap : 64;
    void *p;
    while (n < need)
        n *= 2;
    if (n == *cap)
        return 0;
    p = realloc(*a, n * elem);
    if (p == NULL)
        return SS_ENOMEM;
    *a = p;
    *cap = n;
    return 0;
}

static size_t fence(const vm *m)
{
    return m->nmarks ? m->marks[m->nmarks - 1] : 0;
}

static int push(vm *m, uint32_t depth)
{
    if (m->sp == m->scap &&
        grow((void **)&m->stack, &m->scap, m->sp + 1, sizeof *m->stack) < 0)
        return SS_ENOMEM;
    m->stack[m->sp++] = depth;
    return 0;
}

/* The deepest of the top k values, which are removed; -1 if fewer than k
 * are above the topmost mark. */
static int64_t pop_n(vm *m, size_t k)
{
    uint32_t d = 0;
    if (m->sp - fence(m) < k)
        return -1;
    for (size_t i = m->sp - k; i < m->sp; i++)
        d = m->stack[i] > d ? m->stack[i] : d;
    m->sp -= k;
    return d;
}

/* Everything above the topmost mark, and the mark; -1 without a mark. */
static int64_t pop_mark(vm *m)
{
    int64_t d;
    if (m->nmarks == 0)
        return -1;
    d = pop_n(m, m->sp - fence(m));
    m->nmarks--;
    return d;
}

/* Puts a value of depth d into the container on top (APPEND, BUILD, ...). */
static int into_top(vm *m, int64_t d)
{
    if (d < 0 || m->sp <= fence(m))
        return -1;
    if ((uint32_t)d + 1 > m->stack[m->sp - 1])
        m->stack[m->sp - 1] = (uint32_t)d + 1;
    return 0;
}

/* The opcode's effect on the model: 0, -1 (underflow or a missing memo
 * entry: the model cannot follow), or SS_ENOMEM. memo_ix is the index of a
 * PUT or GET opcode. */
static int step(vm *m, unsigned char op, uint64_t memo_ix)
{
    int64_t a;
    switch (op) {
    case '(':
        if (m->nmarks == m->mcap && grow((void **)&m->marks, &m->mcap,
                                         m->nmarks + 1, sizeof *m->marks) < 0)
            return SS_ENOMEM;
        m->marks[m->nmarks++] = m->sp;
        return 0;
    case '.':
        return pop_n(m, 1) < 0 ? -1 : 0;
    case '0': /* POP: a value, or else the mark on top */
        if (m->nmarks && m->marks[m->nmarks - 1] == m->sp) {
            m->nmarks--;
            return 0;
        }
        return pop_n(m, 1) < 0 ? -1 : 0;
    case '1':
        return pop_mark(m) < 0 ? -1 : 0;
    case '2':
        if (m->sp <= fence(m))
            return -1;
        m->dups++;
        return push(m, m->stack[m->sp - 1]);
    case '}':
    case ']':
    case ')':
    case 0x8f:
        return push(m, 1);
    case 0x85:
    case 0x86:
    case 0x87:
        a = pop_n(m, (size_t)(op - 0x84));
        return a < 0 ? -1 : push(m, (uint32_t)a + 1);
    case 't':
    case 'l':
    case 'd':
    case 0x91:
    case 'i': /* INST: the arguments after the mark */
    case 'o': /* OBJ: the class and its arguments */
        a = pop_mark(m);
        return a < 0 ? -1 : push(m, (uint32_t)a + 1);
    case 'a':
        return into_top(m, pop_n(m, 1));
    case 's':
    case 'b':
        return into_top(m, pop_n(m, op == 's' ? 2 : 1));
    case 'e':
    case 'u':
    case 0x90:
        return into_top(m, pop_mark(m));
    case 0x93: /* STACK_GLOBAL: two names, one global */
        return pop_n(m, 2) < 0 ? -1 : push(m, 0);
    case 'R':
    case 0x81:
    case 0x92: /* REDUCE, NEWOBJ(_EX): what is made may hold the arguments */
        a = pop_n(m, op == 0x92 ? 3 : 2);
        return a < 0 ? -1 : push(m, (uint32_t)a);
    case 'Q':
        return pop_n(m, 1) < 0 ? -1 : push(m, 0);
    case 'p':
    case 'q':
    case 'r':
    case 0x94:
        if (m->sp <= fence(m))
            return -1;
        if (op == 0x94)
            memo_ix = m->filled;
        if (memo_ix >= m->mlen) {
            if (grow((void **)&m->memo, &m->memo_cap, (size_t)memo_ix + 1,
                     sizeof *m->memo) < 0)
                return SS_ENOMEM;
            memset(m->memo + m->mlen, 0,
                   ((size_t)memo_ix + 1 - m->mlen) * sizeof *m->memo);
            m->mlen = (size_t)memo_ix + 1;
        }
        if (m->memo[memo_ix] == 0)
            m->filled++;
        m->memo[memo_ix] = m->stack[m->sp - 1] + 1;
        return 0;
    case 'h':
    case 'j':
        if (memo_ix >= m->mlen || m->memo[memo_ix] == 0)
            return -1;
        return push(m, m->memo[memo_ix] - 1);
    case 0x80:
    case 0x95:
        return 0;
    default: /* every other admitted opcode pushes one scalar */
        return push(m, 0);
    }
}

enum arg_kind {
    A_BAD = 0,  /* not an opcode, or one refused: the scan fails */
    A_NONE,     /* no argument */
    A_FIX,      /* a fixed number of bytes (fix) */
    A_LEN,      /* a little-endian length of fix bytes, then that many */
    A_SLEN4,    /* a signed 4-byte length (negative is malformed), then data */
    A_LINE,     /* one line up to '\n' */
    A_LINE2,    /* two lines */
    A_PUT_LINE, /* PUT: a decimal memo index on one line */
    A_PUT_FIX,  /* BINPUT / LONG_BINPUT: a memo index of fix bytes */
    A_PROTO,    /* PROTO: one byte */
    A_FRAME,    /* FRAME: an 8-byte length of bytes that follow */
};

typedef struct op_form {
    unsigned char kind;
    unsigned char fix;
    const char *name;
} op_form;

#define OP(byte, k, n, nm) [byte] = {k, n, nm}

static const op_form forms[256] = {
    OP('(', A_NONE, 0, "MARK"),
    OP('.', A_NONE, 0, "STOP"),
    OP('0', A_NONE, 0, "POP"),
    OP('1', A_NONE, 0, "POP_MARK"),
    OP('2', A_NONE, 0, "DUP"),
    OP('J', A_FIX, 4, "BININT"),
    OP('K', A_FIX, 1, "BININT1"),
    OP('M', A_FIX, 2, "BININT2"),
    OP('N', A_NONE, 0, "NONE"),
    OP('R', A_NONE, 0, "REDUCE"),
    OP('S', A_LINE, 0, "STRING"),
    OP('T', A_SLEN4, 4, "BINSTRING"),
    OP('U', A_LEN, 1, "SHORT_BINSTRING"),
    OP('V', A_LINE, 0, "UNICODE"),
    OP('X', A_LEN, 4, "BINUNICODE"),
    OP('a', A_NONE, 0, "APPEND"),
    OP('b', A_NONE, 0, "BUILD"),
    OP('c', A_LINE2, 0, "GLOBAL"),
    OP('d', A_NONE, 0, "DICT"),
    OP('}', A_NONE, 0, "EMPTY_DICT"),
    OP('e', A_NONE, 0, "APPENDS"),
    OP('h', A_FIX, 1, "BINGET"),
    OP('i', A_LINE2, 0, "INST"),
    OP('j', A_FIX, 4, "LONG_BINGET"),
    OP('l', A_NONE, 0, "LIST"),
    OP(']', A_NONE, 0, "EMPTY_LIST"),
    OP('o', A_NONE, 0, "OBJ"),
    OP('p', A_PUT_LINE, 0, "PUT"),
    OP('q', A_PUT_FIX, 1, "BINPUT"),
    OP('r', A_PUT_FIX, 4, "LONG_BINPUT"),
    OP('s', A_NONE, 0, "SETITEM"),
    OP('t', A_NONE, 0, "TUPLE"),
    OP(')', A_NONE, 0, "EMPTY_TUPLE"),
    OP('u', A_NONE, 0, "SETITEMS"),
    OP('G', A_FIX, 8, "BINFLOAT"),
    OP('B', A_LEN, 4, "BINBYTES"),
    OP('C', A_LEN, 1, "SHORT_BINBYTES"),
    OP(0x80, A_PROTO, 1, "PROTO"),
    OP(0x81, A_NONE, 0, "NEWOBJ"),
    OP(0x85, A_NONE, 0, "TUPLE1"),
    OP(0x86, A_NONE, 0, "TUPLE2"),
    OP(0x87, A_NONE, 0, "TUPLE3"),
    OP(0x88, A_NONE, 0, "NEWTRUE"),
    OP(0x89, A_NONE, 0, "NEWFALSE"),
    OP(0x8a, A_LEN, 1, "LONG1"),
    OP(0x8b, A_SLEN4, 4, "LONG4"),
    OP(0x8c, A_LEN, 1, "SHORT_BINUNICODE"),
    OP(0x8d, A_LEN, 8, "BINUNICODE8"),
    OP(0x8e, A_LEN, 8, "BINBYTES8"),
    OP(0x8f, A_NONE, 0, "EMPTY_SET"),
    OP(0x90, A_NONE, 0, "ADDITEMS"),
    OP(0x91, A_NONE, 0, "FROZENSET"),
    OP(0x92, A_NONE, 0, "NEWOBJ_EX"),
    OP(0x93, A_NONE, 0, "STACK_GLOBAL"),
    OP(0x94, A_NONE, 0, "MEMOIZE"),
    OP(0x95, A_FRAME, 8, "FRAME"),
    OP(0x96, A_LEN, 8, "BYTEARRAY8"),
    /* refused, by name for the detail: */
    /* text numbers: the C unpickler parses them as NUL-terminated C
     * strings (LONG in base 10), the reference with int()/float() of the
     * whole line (base 0): "I0\x00x" is 0 to one, an error to the other */
    OP('F', A_BAD, 0, "FLOAT"),
    OP('I', A_BAD, 0, "INT"),
    OP('L', A_BAD, 0, "LONG"),
    OP('g', A_BAD, 0, "GET"),
    OP('P', A_BAD, 0, "PERSID"),
    OP('Q', A_BAD, 0, "BINPERSID"),
    OP(0x82, A_BAD, 0, "EXT1"),
    OP(0x83, A_BAD, 0, "EXT2"),
    OP(0x84, A_BAD, 0, "EXT4"),
    OP(0x97, A_BAD, 0, "NEXT_BUFFER"),
    OP(0x98, A_BAD, 0, "READONLY_BUFFER"),
};

#undef OP

#define SS_PICKLE_PROTO_MAX 5

static uint64_t le(const unsigned char *p, unsigned n)
{
    uint64_t v = 0;
    for (unsigned i = n; i-- > 0;)
        v = (v << 8) | p[i];
    return v;
}

/* The offset just past the '\n' ending the line at p, or 0 if none. */
static size_t line_end(const unsigned char *d, size_t p, size_t len)
{
    const unsigned char *nl = memchr(d + p, '\n', len - p);
    return nl ? (size_t)(nl - d) + 1 : 0;
}

int ss_pickle_scan(const void *data, size_t len, ss_pickle_info *info,
                   ss_errinfo *err)
{
    const unsigned char *d = data;
    size_t p = 0, ops = 0, frame_end = 0;
    int proto = 0, rc;
    vm m = {0};

    if (data == NULL && len > 0)
        return ss_errinfo_set(err, SS_EINVAL, "pickle scan", NULL, -1,
                              "no data");
    while (p < len) {
        const size_t at = p;
        const op_form *f = &forms[d[p]];
        uint64_t n = 0;
        size_t left;

        p++;
        left = len - p;
        switch (f->kind) {
        case A_NONE:
            break;
        case A_FIX:
            if (left < f->fix)
                goto short_arg;
            n = le(d + p, f->fix);
            p += f->fix;
            break;
        case A_LEN:
        case A_SLEN4:
            if (left < f->fix)
                goto short_arg;
            n = le(d + p, f->fix);
            if (f->kind == A_SLEN4 && (n & 0x80000000u)) {
                rc = ss_errinfo_set(err, SS_ERANGE, "pickle scan", NULL,
                                    (int64_t)at, "%s with a negative length",
                                    f->name);
                goto out;
            }
            p += f->fix;
            if (n > len - p)
                goto short_arg;
            p += (size_t)n;
            break;
        case A_LINE:
        case A_LINE2:
        case A_PUT_LINE: {
            size_t e = line_end(d, p, len);
            if (e == 0)
                goto short_arg;
            if (f->kind == A_PUT_LINE) {
                /* plain decimal digits only: anything int() would also
                 * accept (signs, spaces, '_') is left to the reference */
                size_t digits = e - 1 - p;
                n = 0;
                if (digits == 0 || digits > 19)
                    goto bad_index;
                for (size_t i = p; i < e - 1; i++) {
                    if (d[i] < '0' || d[i] > '9')
                        goto bad_index;
                    n = n * 10 + (uint64_t)(d[i] - '0');
                }
                if (n > m.filled)
                    goto bad_index;
            }
            p = e;
            if (f->kind == A_LINE2) {
                e = line_end(d, p, len);
                if (e == 0)
                    goto short_arg;
                p = e;
            }
            break;
        }
        case A_PUT_FIX:
            if (left < f->fix)
                goto short_arg;
            n = le(d + p, f->fix);
            if (n > m.filled)
                goto bad_index;
            p += f->fix;
            break;
        case A_PROTO:
            if (left < 1)
                goto short_arg;
            if (at != 0 || d[p] > SS_PICKLE_PROTO_MAX) {
                rc = ss_errinfo_set(err, SS_EINVAL, "pickle scan", NULL,
                                    (int64_t)at,
                                    "PROTO %u at offset %zu (only a leading "
                                    "PROTO <= %d is admitted)",
                                    (unsigned)d[p], at, SS_PICKLE_PROTO_MAX);
                goto out;
            }
            proto = d[p];
            p++;
            break;
        case A_FRAME:
            if (left < 8)
                goto short_arg;
            n = le(d + p, 8);
            p += 8;
            if (n > len - p) {
                rc = ss_errinfo_set(err, SS_ERANGE, "pickle scan", NULL,
                                    (int64_t)at,
                                    "FRAME of %llu bytes with %zu left",
                                    (unsigned long long)n, len - p);
                goto out;
            }
            break;
        default:
            rc = ss_errinfo_set(err, SS_EINVAL, "pickle scan", NULL,
                                (int64_t)at, "opcode %s (0x%02x) is refused",
                                f->name ? f->name : "unknown", (unsigned)d[at]);
            goto out;
        }
        /* CPython's C unpickler holds a frame as one buffer; a read that
         * runs past its end drops the rest of the buffer and reads on from
         * the file (pickle.py refuses such a stream), so it would run other
         * opcodes than the ones scanned: e.g. an argument's bytes here. No
         * opcode may cross the end of the frame it starts in, and no FRAME
         * start inside another. */
        if (at < frame_end && (p > frame_end || d[at] == 0x95)) {
            rc =
                ss_errinfo_set(err, SS_ERANGE, "pickle scan", NULL, (int64_t)at,
                               "%s at %zu runs past the end of its FRAME "
                               "(at %zu) or starts another inside it",
                               f->name, at, frame_end);
            goto out;
        }
        if (d[at] == 0x95)
            frame_end = p + (size_t)n;
        ops++;
        rc = step(&m, d[at], n);
        if (rc == SS_ENOMEM) {
            rc = ss_errinfo_set(err, SS_ENOMEM, "pickle scan", NULL,
                                (int64_t)at, "no memory for the stack model");
            goto out;
        }
        if (rc < 0) {
            rc =
                ss_errinfo_set(err, SS_EINVAL, "pickle scan", NULL, (int64_t)at,
                               "%s on a stack without its operands "
                               "(or a memo entry never stored)",
                               f->name);
            goto out;
        }
        if (m.sp > 0 && m.stack[m.sp - 1] > SS_PICKLE_DEPTH_MAX) {
            rc = ss_errinfo_set(err, SS_ERANGE, "pickle scan", NULL,
                                (int64_t)at, "pickle nests deeper than %d",
                                SS_PICKLE_DEPTH_MAX);
            goto out;
        }
        if (2 * m.dups > p + SS_PICKLE_DUP_SLACK) {
            rc =
                ss_errinfo_set(err, SS_ERANGE, "pickle scan", NULL, (int64_t)at,
                               "%zu DUPs in %zu bytes: more values than "
                               "the stream holds",
                               m.dups, p);
            goto out;
        }
        if (d[at] == '.') {
            if (info != NULL) {
                info->proto = proto;
                info->opcodes = ops;
                info->end = p;
            }
            rc = 0;
            goto out;
        }
        continue;
    short_arg:
        rc = ss_errinfo_set(err, SS_ERANGE, "pickle scan", NULL, (int64_t)at,
                            "%s's argument runs past the end of the data",
                            f->name);
        goto out;
    bad_index:
        rc = ss_errinfo_set(err, SS_ERANGE, "pickle scan", NULL, (int64_t)at,
                            "%s memo index out of bounds (at most %zu here)",
                            f->name, m.filled);
        goto out;
    }
    rc = ss_errinfo_set(err, SS_ERANGE, "pickle scan", NULL, (int64_t)len,
                        "no STOP before the end of the data");
out:
    free(m.stack);
    free(m.marks);
    free(m.memo);
    return rc;
}
