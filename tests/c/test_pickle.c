/* test_pickle.c - ss_pickle_scan: passes streams CPython's pickler writes
 * (protocols 0-5 opcodes), refuses each excluded opcode, a PROTO out of
 * place, forged memo indices, negative lengths and frames past the end,
 * and reads no byte past the data at any truncation (ASan). */
#include "ss_pickle.h"
#include "ss_test.h"

#include <stdlib.h>
#include <string.h>

/* Scan a copy in an exactly sized heap block, so ASan sees any overread. */
static int scan(const char *s, size_t n, ss_pickle_info *info)
{
    char *buf = malloc(n ? n : 1);
    memcpy(buf, s, n);
    int rc = ss_pickle_scan(buf, n, info, NULL);
    free(buf);
    return rc;
}

#define S(lit) (lit), (sizeof(lit) - 1)

static void test_passes_protocol_streams(void)
{
    ss_pickle_info info;
    /* pickle.dumps({'a': [1, 2.0, 'x']}, protocol=4) */
    static const char p4[] =
        "\x80\x04\x95\x1a\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01"
        "a\x94]\x94(K\x01G@\x00\x00\x00\x00\x00\x00\x00\x8c\x01x\x94"
        "es.";
    CHECK_EQ_INT(scan(S(p4), &info), 0);
    CHECK_EQ_INT(info.proto, 4);
    CHECK_EQ_INT(info.end, sizeof(p4) - 1);
    /* protocol 0: text opcodes, PUT lines, no PROTO */
    static const char p0[] = "(dp0\nVa\np1\n(lp2\nS'b'\naVx\np3\nas"
                             "cos\nsep\n0.";
    CHECK_EQ_INT(scan(S(p0), &info), 0);
    CHECK_EQ_INT(info.proto, 0);
    /* protocol 2 GLOBAL + REDUCE, bytes after STOP are not read */
    static const char p2[] = "\x80\x02"
                             "ctorch\nSize\n"
                             "K\x02\x85R.trailing";
    CHECK_EQ_INT(scan(S(p2), &info), 0);
    CHECK_EQ_INT(info.proto, 2);
    CHECK_EQ_INT(info.end, sizeof(p2) - 1 - 8);
    /* LONG1, BINUNICODE8, BYTEARRAY8, SHORT_BINBYTES, sets */
    static const char p5[] =
        "\x80\x05\x8a\x02\xff\x00\x8d\x01\x00\x00\x00\x00\x00\x00\x00z"
        "\x96\x00\x00\x00\x00\x00\x00\x00\x00"
        "C\x01q\x8f(K\x01\x90\x86\x86.";
    CHECK_EQ_INT(scan(S(p5), &info), 0);
    CHECK_EQ_INT(info.proto, 5);
}

static void test_refuses_opcodes(void)
{
    ss_errinfo e;
#define R(lit) {(lit), sizeof(lit) - 1}
    static const struct {
        const char *s;
        size_t n;
    } refused[] = {R("\x80\x02\x82\x01."), R("\x80\x02\x83\x01\x00."),
                   R("\x80\x02\x84\x01\x00\x00\x00."), R("Pid\n."),
                   R("\x80\x02X\x01\x00\x00\x00"
                     "xQ."),
                   R("\x80\x05\x97."), R("\x80\x05N\x98."), R("\x80\x02\xff."),
                   R("\x80\x02\x99."),
                   /* text numbers, which the C unpickler reads up to a NUL */
                   R("I0\x00"
                     "9\n."),
                   R("L010\n."), R("F1.5\n."), R("Np0\ng0\n.")};
#undef R
    for (size_t i = 0; i < sizeof refused / sizeof *refused; i++) {
        ss_errinfo_clear(&e);
        CHECK_EQ_INT(ss_pickle_scan(refused[i].s, refused[i].n, NULL, &e),
                     SS_EINVAL);
        CHECK(strstr(e.detail, "refused") != NULL);
    }
    /* PROTO anywhere but first, or above 5 */
    CHECK_EQ_INT(scan(S("N\x80\x02."), NULL), SS_EINVAL);
    CHECK_EQ_INT(scan(S("\x80\x02\x80\x02N."), NULL), SS_EINVAL);
    CHECK_EQ_INT(scan(S("\x80\x06N."), NULL), SS_EINVAL);
}

static void test_bounds(void)
{
    ss_errinfo e;
    /* memo indices beyond the opcodes before them */
    CHECK_EQ_INT(scan(S("\x80\x04N"
                        "r\xff\xff\xff\xff."),
                      NULL),
                 SS_ERANGE);
    CHECK_EQ_INT(scan(S("\x80\x02Nq\x05."), NULL), SS_ERANGE);
    CHECK_EQ_INT(scan(S("Np99\n."), NULL), SS_ERANGE);
    CHECK_EQ_INT(scan(S("Np-1\n."), NULL), SS_ERANGE);
    CHECK_EQ_INT(scan(S("Np\n."), NULL), SS_ERANGE);
    /* at most the entries stored before: 0, 1, 2, ... */
    CHECK_EQ_INT(scan(S("Np1\n."), NULL), SS_ERANGE);
    CHECK_EQ_INT(scan(S("\x80\x02Nq\x02."), NULL), SS_ERANGE);
    CHECK_EQ_INT(scan(S("Np0\n0Np1\n0Np1\n."), NULL), 0);
    CHECK_EQ_INT(scan(S("\x80\x02Nq\x00\x94h\x01\x86."), NULL), 0);
    CHECK_EQ_INT(scan(S("\x80\x02Nq\x00h\x01\x86."), NULL), SS_EINVAL);
    /* negative signed lengths */
    CHECK_EQ_INT(scan(S("T\xff\xff\xff\xff."), NULL), SS_ERANGE);
    CHECK_EQ_INT(scan(S("\x80\x02\x8b\x00\x00\x00\x80."), NULL), SS_ERANGE);
    /* lengths and frames past the end */
    CHECK_EQ_INT(scan(S("\x80\x02X\x10\x00\x00\x00"
                        "abc."),
                      NULL),
                 SS_ERANGE);
    ss_errinfo_clear(&e);
    CHECK_EQ_INT(
        ss_pickle_scan("\x80\x04\x95\x40\x00\x00\x00\x00\x00\x00\x00N.", 13,
                       NULL, &e),
        SS_ERANGE);
    CHECK(strstr(e.detail, "FRAME") != NULL);
    CHECK_EQ_INT(e.offset, 2);
    CHECK_EQ_INT(
        scan(S("\x80\x04\x95\xff\xff\xff\xff\xff\xff\xff\xffN."), NULL),
        SS_ERANGE);
    /* no STOP; empty */
    CHECK_EQ_INT(scan(S("\x80\x02N"), NULL), SS_ERANGE);
    CHECK_EQ_INT(scan("", 0, NULL), SS_ERANGE);
    CHECK_EQ_INT(ss_pickle_scan(NULL, 4, NULL, NULL), SS_EINVAL);
}

/* An opcode may not cross the end of the FRAME it starts in: CPython's C
 * unpickler would drop the frame's rest and run other bytes as opcodes
 * (here the string's last bytes, "r\xff\xff\xff\x7f": a memo index of
 * 2^31). Frames back to back, and a frame's bytes past STOP, are fine. */
static void test_frames(void)
{
    ss_errinfo e;
    ss_pickle_info info;
    ss_errinfo_clear(&e);
    CHECK_EQ_INT(ss_pickle_scan("\x80\x04\x95\x04\x00\x00\x00\x00\x00\x00\x00"
                                "N\x8c\x08X"
                                "YYYYYYYC\x72"
                                "r\xff\xff\xff\x7f"
                                "0.",
                                27, NULL, &e),
                 SS_ERANGE);
    CHECK(strstr(e.detail, "SHORT_BINUNICODE at 12") != NULL);
    CHECK_EQ_INT(e.offset, 12);
    /* a fixed argument, a text line, and a FRAME inside a frame */
    CHECK_EQ_INT(scan(S("\x80\x04\x95\x02\x00\x00\x00\x00\x00\x00\x00"
                        "J\x01\x02\x03\x04."),
                      NULL),
                 SS_ERANGE);
    CHECK_EQ_INT(scan(S("\x80\x04\x95\x03\x00\x00\x00\x00\x00\x00\x00"
                        "S'abc'\n."),
                      NULL),
                 SS_ERANGE);
    CHECK_EQ_INT(scan(S("\x80\x04\x95\x0a\x00\x00\x00\x00\x00\x00\x00"
                        "\x95\x01\x00\x00\x00\x00\x00\x00\x00N."),
                      NULL),
                 SS_ERANGE);
    /* an opcode ending exactly at the frame's end; the next frame after it */
    CHECK_EQ_INT(scan(S("\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00"
                        "J\x01\x02\x03\x04"
                        "\x95\x01\x00\x00\x00\x00\x00\x00\x00."),
                      &info),
                 0);
    CHECK_EQ_INT(info.end, 26);
    CHECK_EQ_INT(scan(S("\x80\x04\x95\x06\x00\x00\x00\x00\x00\x00\x00"
                        "N.junk"),
                      &info),
                 0);
    CHECK_EQ_INT(info.end, 13);
}

/* n copies of op after prefix, then suffix, in a heap block */
static int scan_rep(const char *prefix, char op, size_t n, const char *suffix)
{
    size_t a = strlen(prefix), c = strlen(suffix);
    char *buf = malloc(a + n + c);
    memcpy(buf, prefix, a);
    memset(buf + a, op, n);
    memcpy(buf + a + n, suffix, c);
    int rc = ss_pickle_scan(buf, a + n + c, NULL, NULL);
    free(buf);
    return rc;
}

static void test_nesting_and_dup(void)
{
    /* a dict SS_PICKLE_DEPTH_MAX deep (its key a tuple one less) passes;
     * one deeper does not, nor a deep set member or deep lists */
    CHECK_EQ_INT(scan_rep("\x80\x02})", '\x85', SS_PICKLE_DEPTH_MAX - 2, "Ns."),
                 0);
    CHECK_EQ_INT(scan_rep("\x80\x02})", '\x85', SS_PICKLE_DEPTH_MAX - 1, "Ns."),
                 SS_ERANGE);
    CHECK_EQ_INT(scan_rep("\x80\x04\x8f()", '\x85', 100000, "\x90."),
                 SS_ERANGE);
    char *deep = malloc(2 + 2 * 5000 + 1);
    memcpy(deep, "\x80\x02", 2);
    memset(deep + 2, ']', 5000);
    memset(deep + 2 + 5000, 'a', 4999);
    deep[2 + 2 * 5000 - 1] = '.';
    CHECK_EQ_INT(ss_pickle_scan(deep, 2 + 2 * 5000, NULL, NULL), SS_ERANGE);
    free(deep);
    /* through the memo: t = (t,), over and over */
    char buf[5 + 6 * 1100 + 1];
    size_t n = 0;
    memcpy(buf, "\x80\x02)q", 4);
    n = 4;
    buf[n++] = 0;
    for (int i = 0; i < 1100; i++) {
        memcpy(buf + n, "0h\x00\x85", 4);
        n += 4;
        buf[n++] = 'q';
        buf[n++] = 0;
    }
    buf[n++] = '.';
    CHECK_EQ_INT(ss_pickle_scan(buf, n, NULL, NULL), SS_ERANGE);
    /* DUP: a few pass, a list of them does not */
    CHECK_EQ_INT(scan_rep("\x80\x02(N", '2', 1000, "l."), 0);
    CHECK_EQ_INT(scan_rep("\x80\x02(N", '2', 1000000, "l."), SS_ERANGE);
    /* underflow */
    CHECK_EQ_INT(scan(S("\x80\x02a."), NULL), SS_EINVAL);
    CHECK_EQ_INT(scan(S("\x80\x02N\x85\x86."), NULL), SS_EINVAL);
}

static void test_every_truncation(void)
{
    static const char full[] = "\x80\x04\x95\x30\x00\x00\x00\x00\x00\x00\x00"
                               "ctorch\nSize\n"
                               "q\x00"
                               "X\x03\x00\x00\x00"
                               "abc\x94"
                               "\x8c\x02hi"
                               "C\x02zz"
                               "J\x01\x02\x03\x04"
                               "G\x00\x00\x00\x00\x00\x00\xf0?"
                               "\x8a\x01\x05"
                               "h\x00"
                               "\x87.";
    size_t n = sizeof(full) - 1;
    CHECK_EQ_INT(scan(full, n, NULL), 0);
    for (size_t cut = 0; cut < n; cut++)
        CHECK(scan(full, cut, NULL) < 0);
    /* random bytes: never a crash or an overread, whatever the verdict */
    char buf[64];
    for (int k = 0; k < 20000; k++) {
        size_t len = (size_t)rnd_in(0, sizeof buf);
        for (size_t i = 0; i < len; i++)
            buf[i] = (char)rnd();
        if (len > 0 && k % 2)
            buf[len - 1] = '.';
        (void)scan(buf, len, NULL);
    }
}

int main(void)
{
    RUN(test_passes_protocol_streams);
    RUN(test_refuses_opcodes);
    RUN(test_bounds);
    RUN(test_frames);
    RUN(test_nesting_and_dup);
    RUN(test_every_truncation);
    return ss_test_report("pickle");
}
