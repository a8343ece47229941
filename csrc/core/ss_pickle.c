/* ss_pickle.c - the opcode scan of ss_pickle.h.
 *
 * One table gives each opcode's argument form (as Lib/pickletools.py
 * documents them); the scan steps over every opcode and its argument,
 * checking each length against the bytes left. Nothing is decoded but
 * lengths, the protocol and memo indices. */
#include "ss_pickle.h"

#include <string.h>

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
    size_t p = 0, ops = 0;
    int proto = 0;

    if (data == NULL && len > 0)
        return ss_errinfo_set(err, SS_EINVAL, "pickle scan", NULL, -1,
                              "no data");
    while (p < len) {
        const size_t at = p;
        const op_form *f = &forms[d[p]];
        uint64_t n;
        size_t left;

        p++;
        left = len - p;
        switch (f->kind) {
        case A_NONE:
            break;
        case A_FIX:
            if (left < f->fix)
                goto short_arg;
            p += f->fix;
            break;
        case A_LEN:
        case A_SLEN4:
            if (left < f->fix)
                goto short_arg;
            n = le(d + p, f->fix);
            if (f->kind == A_SLEN4 && (n & 0x80000000u))
                return ss_errinfo_set(err, SS_ERANGE, "pickle scan", NULL,
                                      (int64_t)at, "%s with a negative length",
                                      f->name);
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
                if (n > ops)
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
            if (n > ops)
                goto bad_index;
            p += f->fix;
            break;
        case A_PROTO:
            if (left < 1)
                goto short_arg;
            if (at != 0 || d[p] > SS_PICKLE_PROTO_MAX)
                return ss_errinfo_set(err, SS_EINVAL, "pickle scan", NULL,
                                      (int64_t)at,
                                      "PROTO %u at offset %zu (only a leading "
                                      "PROTO <= %d is admitted)",
                                      (unsigned)d[p], at, SS_PICKLE_PROTO_MAX);
            proto = d[p];
            p++;
            break;
        case A_FRAME:
            if (left < 8)
                goto short_arg;
            n = le(d + p, 8);
            p += 8;
            if (n > len - p)
                return ss_errinfo_set(err, SS_ERANGE, "pickle scan", NULL,
                                      (int64_t)at,
                                      "FRAME of %llu bytes with %zu left",
                                      (unsigned long long)n, len - p);
            break;
        default:
            return ss_errinfo_set(err, SS_EINVAL, "pickle scan", NULL,
                                  (int64_t)at, "opcode %s (0x%02x) is refused",
                                  f->name ? f->name : "unknown",
                                  (unsigned)d[at]);
        }
        ops++;
        if (d[at] == '.') {
            if (info != NULL) {
                info->proto = proto;
                info->opcodes = ops;
                info->end = p;
            }
            return 0;
        }
        continue;
    short_arg:
        return ss_errinfo_set(err, SS_ERANGE, "pickle scan", NULL, (int64_t)at,
                              "%s's argument runs past the end of the data",
                              f->name);
    bad_index:
        return ss_errinfo_set(err, SS_ERANGE, "pickle scan", NULL, (int64_t)at,
                              "%s memo index out of bounds (at most %zu here)",
                              f->name, ops);
    }
    return ss_errinfo_set(err, SS_ERANGE, "pickle scan", NULL, (int64_t)len,
                          "no STOP before the end of the data");
}
