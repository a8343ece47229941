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
    CHECK_EQ_INT(scan(S("Np1\n."), NULL),
                 0); /* one opcode before: index 1 ok */
    CHECK_EQ_INT(scan(S("\x80\x02Nq\x02."), NULL), 0);
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
    RUN(test_every_truncation);
    return ss_test_report("pickle");
}
