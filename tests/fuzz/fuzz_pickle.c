/* fuzz_pickle.c - libFuzzer harness for ss_pickle_scan (csrc/core/ss_pickle.c),
 * the bounds scan that decides whether CPython's C unpickler may run on a
 * .metadata or a bytes item read from disk.
 *
 * Built with -fsanitize=fuzzer,address,undefined (make fuzz): any read past
 * the input, leak or undefined behaviour is a crash. Beyond that it checks
 * what ss_pickle.h promises, against an independent walk of the opcodes
 * (walk() below, written from pickletools' argument table, not from
 * ss_pickle.c):
 *  - the scan returns 0, SS_EINVAL, SS_ERANGE or SS_ENOMEM, and err says
 *    the same code, an offset inside [0, len] and a detail;
 *  - a pass is one the walk proves: no refused opcode, every argument and
 *    frame inside the data, every opcode that starts inside a FRAME ending
 *    inside it and no FRAME inside another (the C unpickler would skip the
 *    rest of the frame), PROTO only first and at most 5, every memo
 *    index stored at most the entries stored before it, every BINGET of a
 *    stored entry, DUPs within the stream's bytes plus the slack; the scan
 *    and the walk agree on where STOP ends, how many opcodes there are
 *    and the protocol;
 *  - nothing after STOP is read: the scan of the bytes up to STOP, and of
 *    them with junk after, passes with the same result (only a FRAME's
 *    length may count the bytes after STOP: the C unpickler reads a whole
 *    frame, so one that reaches past STOP passes only with those bytes);
 *  - truncation is a bounds failure: every prefix shorter than the STOP's
 *    end fails with SS_ERANGE (two are tried per input);
 *  - the scan is deterministic: the same bytes give the same code.
 * A violated property aborts, so libFuzzer keeps the input. */
#include "ss_pickle.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ss_pickle.h: "PROTO ... with a version of at most 5" */
#define PROTO_MAX 5

#define CHECK(cond, ...)                                                       \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "fuzz_pickle: %s failed: ", #cond);                \
            fprintf(stderr, __VA_ARGS__);                                      \
            fprintf(stderr, "\n");                                             \
            abort();                                                           \
        }                                                                      \
    } while (0)

/* What the independent walk makes of a stream. */
typedef struct walk_result {
    int ok;           /* every opcode-level property of ss_pickle.h holds */
    size_t end;       /* just past the first STOP */
    size_t ops;       /* opcodes up to and including it */
    int proto;        /* the leading PROTO's version, else 0 */
    size_t frame_end; /* the end of the last FRAME */
    char why[96];     /* the first property that fails */
} walk_result;

static uint64_t le_u(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* Offset of the byte after the next '\n' at or after p, or 0 if none. */
static size_t after_newline(const uint8_t *d, size_t p, size_t n)
{
    for (size_t i = p; i < n; i++)
        if (d[i] == '\n')
            return i + 1;
    return 0;
}

static int fail(walk_result *w, const char *why, size_t at)
{
    w->ok = 0;
    snprintf(w->why, sizeof w->why, "%s at %zu", why, at);
    return 0;
}

/* Opcodes by the shape of their argument, as pickletools documents them. */
#define IN(set, op) (memchr(set, op, sizeof set - 1) != NULL)
static const char REFUSED[] = "FILgPQ\x82\x83\x84\x97\x98";
static const char NO_ARG[] = "(.012NRabd}el]ost)u\x81\x85\x86\x87\x88\x89"
                             "\x8f\x90\x91\x92\x93\x94";
static const char FIX1[] = "Khq\x80", FIX2[] = "M", FIX4[] = "Jjr";
static const char FIX8[] = "G\x95";
static const char LEN1[] = "UC\x8a\x8c", LEN4[] = "XB", SLEN4[] = "T\x8b";
static const char LEN8[] = "\x8d\x8e\x96";
static const char LINE1[] = "SVp", LINE2[] = "ci";

/* The argument of the opcode at d[at]: how many bytes it takes (*argn),
 * its integer value where it has one (*val). 0 when the opcode is refused
 * (text numbers, text GET, persistent ids, copyreg extensions, out-of-band
 * buffers) or unknown, or its argument does not fit. */
static int argument(walk_result *w, const uint8_t *d, size_t n, size_t at,
                    size_t *argn, uint64_t *val)
{
    const uint8_t op = d[at];
    const size_t p = at + 1, left = n - p;
    int fixed = -1, lenbytes = 0, lines = 0;

    *val = 0;
    if (op == 0 || IN(REFUSED, op))
        return fail(w, "refused or unknown opcode", at);
    if (IN(NO_ARG, op))
        fixed = 0;
    else if (IN(FIX1, op))
        fixed = 1;
    else if (IN(FIX2, op))
        fixed = 2;
    else if (IN(FIX4, op))
        fixed = 4;
    else if (IN(FIX8, op))
        fixed = 8;
    else if (IN(LEN1, op))
        lenbytes = 1;
    else if (IN(LEN4, op) || IN(SLEN4, op))
        lenbytes = 4;
    else if (IN(LEN8, op))
        lenbytes = 8;
    else if (IN(LINE1, op))
        lines = 1;
    else if (IN(LINE2, op))
        lines = 2;
    else
        return fail(w, "refused or unknown opcode", at);
    if (fixed >= 0) {
        if (left < (size_t)fixed)
            return fail(w, "short fixed argument", at);
        *argn = (size_t)fixed;
        *val = le_u(d + p, fixed);
        return 1;
    }
    if (lenbytes) {
        uint64_t len;
        if (left < (size_t)lenbytes)
            return fail(w, "short length", at);
        len = le_u(d + p, lenbytes);
        if (IN(SLEN4, op) && len >= 0x80000000u)
            return fail(w, "negative length", at);
        if (len > left - (size_t)lenbytes)
            return fail(w, "length past the end", at);
        *argn = (size_t)lenbytes + (size_t)len;
        return 1;
    }
    {
        size_t q = p, e = 0;
        for (int i = 0; i < lines; i++) {
            e = after_newline(d, q, n);
            if (e == 0)
                return fail(w, "unterminated line", at);
            if (op == 'p') { /* PUT: plain decimal digits, 1 to 19 */
                if (e - 1 - q == 0 || e - 1 - q > 19)
                    return fail(w, "PUT index not 1-19 digits", at);
                for (size_t k = q; k < e - 1; k++) {
                    if (d[k] < '0' || d[k] > '9')
                        return fail(w, "PUT index not decimal", at);
                    *val = *val * 10 + (uint64_t)(d[k] - '0');
                }
            }
            q = e;
        }
        *argn = e - p;
        return 1;
    }
}

/* Walks the opcodes to the first STOP, checking ss_pickle.h's opcode-level
 * properties (not the stack model's: underflow and nesting are the scan's
 * own business and may refuse more). */
static walk_result walk(const uint8_t *d, size_t n)
{
    walk_result w = {1, 0, 0, 0, 0, ""};
    uint64_t stored = 0; /* memo entries stored: indices 0 .. stored-1 */
    uint64_t dups = 0;
    size_t p = 0;

    while (p < n) {
        const size_t at = p;
        const uint8_t op = d[p];
        size_t argn = 0;
        uint64_t v = 0;

        if (!argument(&w, d, n, at, &argn, &v))
            return w;
        p = at + 1 + argn;
        /* inside a frame, an opcode ends in it and no FRAME starts */
        if (at < w.frame_end && (p > w.frame_end || op == 0x95)) {
            fail(&w, "opcode across the end of its FRAME", at);
            return w;
        }
        w.ops++;
        switch (op) {
        case 0x80:
            if (at != 0 || v > PROTO_MAX) {
                fail(&w, "PROTO out of place or too new", at);
                return w;
            }
            w.proto = (int)v;
            break;
        case 0x95:
            if (v > n - p) {
                fail(&w, "FRAME past the end", at);
                return w;
            }
            w.frame_end = p + (size_t)v;
            break;
        case 'p':
        case 'q':
        case 'r':
            if (v > stored) {
                fail(&w, "memo index past the entries stored", at);
                return w;
            }
            stored += v == stored;
            break;
        case 0x94:
            stored++;
            break;
        case 'h':
        case 'j':
            if (v >= stored) {
                fail(&w, "BINGET of an entry never stored", at);
                return w;
            }
            break;
        case '2':
            dups++;
            if (2 * dups > p + SS_PICKLE_DUP_SLACK) {
                fail(&w, "DUPs past the stream's bytes", at);
                return w;
            }
            break;
        case '.':
            w.end = p;
            return w;
        default:
            break;
        }
    }
    fail(&w, "no STOP", n);
    return w;
}

/* The scan of a private, exactly sized copy (ASan sees any overread). */
static int scan(const uint8_t *data, size_t n, ss_pickle_info *info,
                ss_errinfo *err)
{
    uint8_t *copy = malloc(n ? n : 1);
    int rc;
    CHECK(copy != NULL, "malloc(%zu)", n);
    if (n)
        memcpy(copy, data, n);
    ss_errinfo_clear(err);
    rc = ss_pickle_scan(n ? copy : NULL, n, info, err);
    free(copy);
    return rc;
}

static void check_error(int rc, const ss_errinfo *err, size_t n)
{
    CHECK(rc == SS_EINVAL || rc == SS_ERANGE || rc == SS_ENOMEM,
          "unexpected result %d", rc);
    CHECK(err->code == rc, "err.code %d for result %d", err->code, rc);
    CHECK(err->offset >= 0 && (uint64_t)err->offset <= n,
          "err.offset %lld outside [0, %zu]", (long long)err->offset, n);
    CHECK(err->detail[0] != '\0', "no detail for result %d", rc);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    ss_pickle_info info, again;
    ss_errinfo err;
    walk_result w = walk(data, size);
    int rc = scan(data, size, &info, &err);

    CHECK(scan(data, size, &again, &err) == rc, "two scans differ");
    if (rc != 0) {
        check_error(rc, &err, size);
        return 0;
    }
    CHECK(w.ok, "the scan passed what the walk refuses: %s", w.why);
    CHECK(info.end == w.end && info.opcodes == w.ops && info.proto == w.proto,
          "scan (end %zu, %zu ops, proto %d) != walk (end %zu, %zu ops, "
          "proto %d)",
          info.end, info.opcodes, info.proto, w.end, w.ops, w.proto);
    CHECK(info.end >= 1 && info.end <= size && data[info.end - 1] == '.',
          "end %zu of %zu is not just past a STOP", info.end, size);

    /* Nothing after STOP is read: the stream alone, and with junk after. */
    rc = scan(data, info.end, &again, &err);
    if (w.frame_end > info.end)
        CHECK(rc == SS_ERANGE, "a FRAME past STOP, cut at STOP, gives %d", rc);
    else
        CHECK(rc == 0 && again.end == info.end &&
                  again.opcodes == info.opcodes && again.proto == info.proto,
              "the bytes up to STOP alone scan differently (%d)", rc);
    {
        uint8_t *longer = malloc(size + 8);
        CHECK(longer != NULL, "malloc");
        memcpy(longer, data, size);
        memcpy(longer + size, "\x82\x97PQ(((", 8); /* refused opcodes */
        rc = scan(longer, size + 8, &again, &err);
        free(longer);
        CHECK(rc == 0 && again.end == info.end,
              "junk after STOP changes the scan (%d)", rc);
    }

    /* Truncation is a bounds failure, never a pass or another error. */
    {
        const size_t cuts[2] = {info.end - 1, info.end / 2};
        for (int i = 0; i < 2; i++) {
            rc = scan(data, cuts[i], &again, &err);
            CHECK(rc == SS_ERANGE,
                  "a prefix of %zu bytes (STOP ends at %zu) "
                  "gives %d, not SS_ERANGE",
                  cuts[i], info.end, rc);
            check_error(rc, &err, cuts[i]);
        }
    }
    return 0;
}
