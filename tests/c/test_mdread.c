/* test_mdread.c - ss_mdread_decode: the node table of streams CPython's
 * pickler writes (protocols 3-5), containers filled in several batches,
 * (one after another in the kids, or apart), ints at every width, the
 * memo's share slots, a pathlib path's REDUCE;
 * refusal of every form outside the decoded set and of every bound (memo order,
 * frames, lengths, stack); and no byte read past the data at any truncation
 * (ASan). */
#include "ss_mdread.h"
#include "ss_test.h"

#include <stdlib.h>
#include <string.h>

/* Decode a copy in an exactly sized heap block, so ASan sees any overread.
 * The copy must outlive the result: *keep holds it (free after). */
static int dec(const char *s, size_t n, ss_mdread **r, char **keep)
{
    char *buf = malloc(n ? n : 1);
    ss_mdread *out = NULL;
    int rc;
    memcpy(buf, s, n);
    rc = ss_mdread_decode(buf, n, &out, NULL);
    if (r != NULL && keep != NULL) {
        *r = out;
        *keep = buf;
    } else {
        ss_mdread_free(out);
        free(buf);
    }
    return rc;
}

#define S(lit) (lit), (sizeof(lit) - 1)

static const ss_md_node *node(const ss_md_result *res, uint32_t i)
{
    return &res->nodes[i];
}

static int64_t ival(const ss_md_node *n)
{
    return (int64_t)((uint64_t)n->b << 32 | n->a);
}

static void test_decodes_a_dict(void)
{
    /* pickle.dumps({'a': [1, 2.0, 'x']}, protocol=4) */
    static const char p4[] =
        "\x80\x04\x95\x1a\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01"
        "a\x94]\x94(K\x01G@\x00\x00\x00\x00\x00\x00\x00\x8c\x01x\x94"
        "es.";
    ss_mdread *r;
    char *buf;
    CHECK_EQ_INT(dec(S(p4), &r, &buf), 0);
    if (r == NULL) {
        free(buf);
        return;
    }
    const ss_md_result *res = ss_mdread_result(r);
    const ss_md_node *d = node(res, res->root), *k, *l;
    CHECK_EQ_INT(res->proto, 4);
    CHECK_EQ_INT(d->kind, SS_MD_DICT);
    CHECK_EQ_INT(d->b, 1);
    k = node(res, res->kids[d->a]);
    l = node(res, res->kids[d->a + 1]);
    CHECK_EQ_INT(k->kind, SS_MD_STR);
    CHECK(k->b == 1 && buf[k->a] == 'a');
    CHECK_EQ_INT(l->kind, SS_MD_LIST);
    CHECK_EQ_INT(l->b, 3);
    CHECK_EQ_INT(ival(node(res, res->kids[l->a])), 1);
    CHECK_EQ_INT(node(res, res->kids[l->a + 1])->kind, SS_MD_FLOAT);
    CHECK_EQ_INT(node(res, res->kids[l->a + 2])->kind, SS_MD_STR);
    CHECK_EQ_INT(res->shared, 0);
    ss_mdread_free(r);
    free(buf);
}

static void test_ints_batches_memo_and_globals(void)
{
    /* protocol 3: GLOBAL, REDUCE of a tuple, BINPUT/BINGET (a share slot),
     * a list filled by two APPENDS and an APPEND, ints of every width */
    static const char p3[] =
        "\x80\x03"
        "ctorch\nSize\nq\x00"      /* GLOBAL, memo 0 */
        "K\x02\x85R"               /* Size((2,)) */
        "]q\x01(J\xfe\xff\xff\xff" /* [-2 */
        "M\xff\xff"
        "e"                                         /* , 65535] */
        "(\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80" /* INT64_MIN */
        "\x8a\x00"                                  /* 0 */
        "M\xff\xff" /* 65535 again: the same node */
        "e"
        "h\x00"
        "a"      /* the GLOBAL again: shared */
        "\x86."; /* (Size, list) */
    ss_mdread *r;
    char *buf;
    CHECK_EQ_INT(dec(S(p3), &r, &buf), 0);
    if (r == NULL) {
        free(buf);
        return;
    }
    const ss_md_result *res = ss_mdread_result(r);
    const ss_md_node *t = node(res, res->root), *red, *g, *l;
    CHECK_EQ_INT(t->kind, SS_MD_TUPLE);
    CHECK_EQ_INT(t->b, 2);
    red = node(res, res->kids[t->a]);
    l = node(res, res->kids[t->a + 1]);
    CHECK_EQ_INT(red->kind, SS_MD_REDUCE);
    g = node(res, red->a);
    CHECK_EQ_INT(g->kind, SS_MD_GLOBAL);
    CHECK(node(res, g->a)->b == 5 &&
          memcmp(buf + node(res, g->a)->a, "torch", 5) == 0);
    CHECK_EQ_INT(g->share, 1);
    CHECK_EQ_INT(res->shared, 1);
    CHECK_EQ_INT(l->kind, SS_MD_LIST);
    CHECK_EQ_INT(l->b, 6);
    const uint32_t *k = res->kids + l->a;
    CHECK_EQ_INT(ival(node(res, k[0])), -2);
    CHECK_EQ_INT(ival(node(res, k[1])), 65535);
    CHECK(ival(node(res, k[2])) == INT64_MIN);
    CHECK_EQ_INT(ival(node(res, k[3])), 0);
    CHECK_EQ_INT(k[1], k[4]); /* one node for 65535 */
    CHECK_EQ_INT(k[5], red->a);
    ss_mdread_free(r);
    free(buf);
}

static void test_path_reduce(void)
{
    /* every save's StorageMeta.checkpoint_id: a REDUCE of a pathlib class
     * with its parts; pickle.dumps(PurePosixPath('/a/b'), protocol=4), and
     * PureWindowsPath('C:/x') at protocol 3 (GLOBAL) */
    static const char p4[] =
        "\x80\x04\x95-\x00\x00\x00\x00\x00\x00\x00\x8c\x07pathlib\x94\x8c\r"
        "PurePosixPath\x94\x93\x94\x8c\x01/\x94\x8c\x01"
        "a\x94\x8c\x01"
        "b\x94\x87\x94R\x94.";
    static const char p3[] = "\x80\x03"
                             "cpathlib\nPureWindowsPath\nq\x00X\x03\x00\x00\x00"
                             "C:\\q\x01X\x01\x00\x00\x00xq\x02\x86q\x03Rq\x04.";
    static const struct {
        const char *s;
        size_t n;
        const char *cls, *last;
        uint32_t nparts;
    } cases[] = {{S(p4), "PurePosixPath", "b", 3},
                 {S(p3), "PureWindowsPath", "x", 2}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        ss_mdread *r;
        char *buf;
        CHECK_EQ_INT(dec(cases[c].s, cases[c].n, &r, &buf), 0);
        if (r == NULL) {
            free(buf);
            continue;
        }
        const ss_md_result *res = ss_mdread_result(r);
        const ss_md_node *red = node(res, res->root), *g, *args, *nm, *last;
        CHECK_EQ_INT(red->kind, SS_MD_REDUCE);
        CHECK_EQ_INT(red->c, 0);
        g = node(res, red->a);
        args = node(res, red->b);
        CHECK_EQ_INT(g->kind, SS_MD_GLOBAL);
        CHECK(node(res, g->a)->b == 7 &&
              memcmp(buf + node(res, g->a)->a, "pathlib", 7) == 0);
        nm = node(res, g->b);
        CHECK(nm->b == strlen(cases[c].cls) &&
              memcmp(buf + nm->a, cases[c].cls, nm->b) == 0);
        CHECK_EQ_INT(args->kind, SS_MD_TUPLE);
        CHECK_EQ_INT(args->b, cases[c].nparts);
        for (uint32_t k = 0; k < args->b; k++)
            CHECK_EQ_INT(node(res, res->kids[args->a + k])->kind, SS_MD_STR);
        last = node(res, res->kids[args->a + args->b - 1]);
        CHECK(last->b == 1 && buf[last->a] == cases[c].last[0]);
        ss_mdread_free(r);
        free(buf);
    }
}

static void test_refuses(void)
{
#define R(lit, code)                                                           \
    {                                                                          \
        (lit), sizeof(lit) - 1, (code)                                         \
    }
    static const struct {
        const char *s;
        size_t n;
        int code;
    } cases[] = {
        R("\x80\x02N.", SS_EINVAL),          /* protocol 2 */
        R("N.", SS_EINVAL),                  /* no PROTO */
        R("\x80\x04N2.", SS_EINVAL),         /* DUP */
        R("\x80\x04NN0.", SS_EINVAL),        /* POP */
        R("\x80\x04I1\n.", SS_EINVAL),       /* text INT */
        R("\x80\x04\x80\x04N.", SS_EINVAL),  /* PROTO again */
        R("\x80\x04Nq\x01.", SS_ERANGE),     /* memo index skipped */
        R("\x80\x04h\x00.", SS_ERANGE),      /* GET of nothing */
        R("\x80\x04}Na.", SS_EINVAL),        /* APPEND on a dict */
        R("\x80\x04](Nu.", SS_EINVAL),       /* SETITEMS on a list */
        R("\x80\x04}(Nu.", SS_EINVAL),       /* odd SETITEMS */
        R("\x80\x04NN.", SS_EINVAL),         /* two values at STOP */
        R("\x80\x04(N.", SS_EINVAL),         /* open MARK at STOP */
        R("\x80\x04N}b.", SS_EINVAL),        /* BUILD on None */
        R("\x80\x04N)\x81}b}b.", SS_EINVAL), /* BUILD twice */
        R("\x80\x04NN\x81.", SS_EINVAL),     /* NEWOBJ args not a tuple */
        R("\x80\x04K\x01N\x93.", SS_EINVAL), /* STACK_GLOBAL of an int */
        R("\x80\x04\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01"
          ".",
          SS_EINVAL), /* int beyond int64 */
        R("\x80\x04\x8c\x05"
          "ab.",
          SS_ERANGE),                  /* string past the end */
        R("\x80\x04N", SS_ERANGE),     /* no STOP */
        R("\x80\x04t.", SS_EINVAL),    /* TUPLE without MARK */
        R("\x80\x04\x85.", SS_EINVAL), /* TUPLE1 of nothing */
        R("\x80\x04(a.", SS_EINVAL),   /* APPEND under a MARK */
        R("\x80\x04\x95\x02\x00\x00\x00\x00\x00\x00\x00J\x01\x02\x03\x04.",
          SS_ERANGE), /* across a FRAME's end */
        R("\x80\x04\x95\x0a\x00\x00\x00\x00\x00\x00\x00"
          "\x95\x01\x00\x00\x00\x00\x00\x00\x00N.",
          SS_EINVAL), /* FRAME in a FRAME */
        R("\x80\x04\x95\xff\x00\x00\x00\x00\x00\x00\x00N.",
          SS_ERANGE), /* FRAME past the end */
        R("\x80\x04"
          "ctorch\nSize",
          SS_ERANGE), /* GLOBAL without newline */
    };
#undef R
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ss_errinfo e;
        char *buf = malloc(cases[i].n);
        ss_mdread *r = (ss_mdread *)1;
        memcpy(buf, cases[i].s, cases[i].n);
        ss_errinfo_clear(&e);
        int rc = ss_mdread_decode(buf, cases[i].n, &r, &e);
        if (rc != cases[i].code)
            fprintf(stderr, "case %zu: rc %d\n", i, rc);
        CHECK_EQ_INT(rc, cases[i].code);
        CHECK(r == NULL);
        CHECK_EQ_INT(e.code, cases[i].code);
        CHECK(e.offset >= 0 && (size_t)e.offset <= cases[i].n);
        free(buf);
    }
}

static void test_truncations_and_flips(void)
{
    /* pickle.dumps(Metadata({'w': BytesStorageMetadata()}, None, {}, None,
     * '1.0.0')) of torch 2.13's classes */
    static const char md[] =
        "\x80\x04\x95\xbc\x00\x00\x00\x00\x00\x00\x00\x8c\x25\x74\x6f\x72"
        "\x63\x68\x2e\x64\x69\x73\x74\x72\x69\x62\x75\x74\x65\x64\x2e\x63"
        "\x68\x65\x63\x6b\x70\x6f\x69\x6e\x74\x2e\x6d\x65\x74\x61\x64\x61"
        "\x74\x61\x94\x8c\x08\x4d\x65\x74\x61\x64\x61\x74\x61\x94\x93\x94"
        "\x29\x81\x94\x7d\x94\x28\x8c\x13\x73\x74\x61\x74\x65\x5f\x64\x69"
        "\x63\x74\x5f\x6d\x65\x74\x61\x64\x61\x74\x61\x94\x7d\x94\x8c\x01"
        "\x77\x94\x68\x00\x8c\x14\x42\x79\x74\x65\x73\x53\x74\x6f\x72\x61"
        "\x67\x65\x4d\x65\x74\x61\x64\x61\x74\x61\x94\x93\x94\x29\x81\x94"
        "\x73\x8c\x0c\x70\x6c\x61\x6e\x6e\x65\x72\x5f\x64\x61\x74\x61\x94"
        "\x4e\x8c\x0c\x73\x74\x6f\x72\x61\x67\x65\x5f\x64\x61\x74\x61\x94"
        "\x7d\x94\x8c\x0c\x73\x74\x6f\x72\x61\x67\x65\x5f\x6d\x65\x74\x61"
        "\x94\x4e\x8c\x07\x76\x65\x72\x73\x69\x6f\x6e\x94\x8c\x05\x31\x2e"
        "\x30\x2e\x30\x94\x75\x62\x2e";
    size_t n = sizeof md - 1;
    CHECK_EQ_INT(dec(md, n, NULL, NULL), 0);
    for (size_t k = 0; k < n; k++) {
        int rc = dec(md, k, NULL, NULL);
        CHECK(rc == SS_ERANGE || rc == SS_EINVAL);
    }
    /* every byte flipped to a few values: any answer, no overread, no leak */
    char *buf = malloc(n);
    for (size_t k = 0; k < n; k++)
        for (int v = 0; v < 256; v += 37) {
            memcpy(buf, md, n);
            buf[k] = (char)v;
            int rc = dec(buf, n, NULL, NULL);
            CHECK(rc == 0 || rc == SS_ERANGE || rc == SS_EINVAL);
        }
    free(buf);
}

static void test_many_items(void)
{
    /* a list of 5000 items in 5 APPENDS batches, and a memo past 256 entries
     * (LONG_BINPUT / LONG_BINGET) */
    size_t n = 2 + 1 + 5 * (1 + 1000 * 2 + 1) + 5 + 1 + 1;
    char *s = malloc(n + 16), *p = s;
    memcpy(p, "\x80\x04]", 3);
    p += 3;
    for (int b = 0; b < 5; b++) {
        *p++ = '(';
        for (int i = 0; i < 1000; i++) {
            *p++ = 'K';
            *p++ = (char)(i & 0xff);
        }
        *p++ = 'e';
    }
    memcpy(p, "r\x00\x00\x00\x00j\x00\x00\x00\x00\x86.", 12);
    p += 12;
    ss_mdread *r;
    char *keep;
    CHECK_EQ_INT(dec(s, (size_t)(p - s), &r, &keep), 0);
    if (r == NULL) {
        free(keep);
        return;
    }
    const ss_md_result *res = ss_mdread_result(r);
    const ss_md_node *t = node(res, res->root);
    CHECK_EQ_INT(t->kind, SS_MD_TUPLE);
    CHECK_EQ_INT(res->kids[t->a], res->kids[t->a + 1]);
    const ss_md_node *l = node(res, res->kids[t->a]);
    CHECK_EQ_INT(l->b, 5000);
    for (uint32_t i = 0; i < 5000; i++)
        CHECK_EQ_INT(ival(node(res, res->kids[l->a + i])),
                     (int)(i % 1000) & 0xff);
    ss_mdread_free(r);
    free(keep);
    free(s);
}

static void test_batches_after_a_run(void)
{
    /* ([1, 2, 3, 4], {5: 6, 7: 8, 9: 10}, [11, 12], {13: 14}, []): the first
     * two filled by APPEND / SETITEM, then batches (a run, then segments),
     * the next two in one batch each, the last never */
    static const char p[] = "\x80\x04(]K\x01"
                            "a(K\x02K\x03"
                            "eK\x04"
                            "a"
                            "}K\x05K\x06s(K\x07K\x08K\x09K\x0a"
                            "u"
                            "](K\x0bK\x0c"
                            "e}K\x0dK\x0es]t.";
    static const int want[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14};
    ss_mdread *r;
    char *buf;
    CHECK_EQ_INT(dec(S(p), &r, &buf), 0);
    if (r == NULL) {
        free(buf);
        return;
    }
    const ss_md_result *res = ss_mdread_result(r);
    const ss_md_node *t = node(res, res->root);
    static const uint32_t count[] = {4, 3, 2, 1, 0},
                          kinds[] = {SS_MD_LIST, SS_MD_DICT, SS_MD_LIST,
                                     SS_MD_DICT, SS_MD_LIST};
    int w = 0;
    CHECK_EQ_INT(t->kind, SS_MD_TUPLE);
    CHECK_EQ_INT(t->b, 5);
    for (uint32_t j = 0; j < 5 && t->b == 5; j++) {
        const ss_md_node *c = node(res, res->kids[t->a + j]);
        uint32_t nk = c->kind == SS_MD_DICT ? 2 * c->b : c->b;
        CHECK_EQ_INT(c->kind, (int)kinds[j]);
        CHECK_EQ_INT(c->b, (int)count[j]);
        CHECK(c->a + nk <= res->nkids);
        for (uint32_t k = 0; k < nk && w < 14; k++)
            CHECK_EQ_INT(ival(node(res, res->kids[c->a + k])), want[w++]);
    }
    CHECK_EQ_INT(w, 14);
    ss_mdread_free(r);
    free(buf);
}

static void test_batches_apart_and_together(void)
{
    /* [1, 2, [3, 4], 5] in two APPENDS batches with the inner list's items
     * between them (segments apart: flatten copies them into one run),
     * and the inner list's one batch */
    static const char p[] = "\x80\x04](K\x01K\x02"
                            "e(](K\x03K\x04"
                            "eK\x05"
                            "e.";
    static const int want[] = {1, 2, -1, 5};
    ss_mdread *r;
    char *buf;
    CHECK_EQ_INT(dec(S(p), &r, &buf), 0);
    if (r == NULL) {
        free(buf);
        return;
    }
    const ss_md_result *res = ss_mdread_result(r);
    const ss_md_node *a = node(res, res->root), *b;
    CHECK_EQ_INT(a->kind, SS_MD_LIST);
    CHECK_EQ_INT(a->b, 4);
    CHECK(a->a + 4 <= res->nkids);
    for (uint32_t k = 0; k < 4 && a->b == 4; k++)
        if (want[k] >= 0)
            CHECK_EQ_INT(ival(node(res, res->kids[a->a + k])), want[k]);
    b = node(res, res->kids[a->a + 2]);
    CHECK_EQ_INT(b->kind, SS_MD_LIST);
    CHECK_EQ_INT(b->b, 2);
    CHECK_EQ_INT(ival(node(res, res->kids[b->a])), 3);
    CHECK_EQ_INT(ival(node(res, res->kids[b->a + 1])), 4);
    ss_mdread_free(r);
    free(buf);
}

static void test_memo_fetched_only(void)
{
    /* ((s0, ..., s199), (s0, s63, s64, s127, s199, z, z)): 200 memoized
     * strings, GETs across the prescan's 64-index words, and index 5 put
     * again (z) before the GET that names it */
    char s[3 + 200 * 4 + 15 + 11], *p = s;
    memcpy(p, "\x80\x04(", 3);
    p += 3;
    for (int k = 0; k < 200; k++) {
        *p++ = '\x8c';
        *p++ = 1;
        *p++ = (char)k;
        *p++ = '\x94';
    }
    memcpy(p, "t(h\x00h\x3fh\x40h\x7fj\xc7\x00\x00\x00", 15);
    p += 15;
    memcpy(p, "\x8c\x01Zq\x05h\x05t\x86.", 11);
    p += 11;
    ss_mdread *r;
    char *buf;
    CHECK_EQ_INT(dec(s, (size_t)(p - s), &r, &buf), 0);
    if (r == NULL) {
        free(buf);
        return;
    }
    const ss_md_result *res = ss_mdread_result(r);
    const ss_md_node *root = node(res, res->root), *t, *u;
    static const int got[] = {0, 63, 64, 127, 199};
    CHECK_EQ_INT(root->kind, SS_MD_TUPLE);
    t = node(res, res->kids[root->a]);
    u = node(res, res->kids[root->a + 1]);
    CHECK_EQ_INT(t->b, 200);
    CHECK_EQ_INT(u->b, 7);
    if (t->b == 200 && u->b == 7) {
        for (int j = 0; j < 5; j++) {
            CHECK_EQ_INT(res->kids[u->a + j], res->kids[t->a + got[j]]);
            CHECK(node(res, res->kids[u->a + j])->share != 0);
        }
        CHECK_EQ_INT(res->kids[u->a + 5], res->kids[u->a + 6]);
        CHECK(buf[node(res, res->kids[u->a + 6])->a] == 'Z');
        CHECK_EQ_INT(node(res, res->kids[t->a + 5])->share, 0);
        CHECK_EQ_INT(node(res, res->kids[t->a + 1])->share, 0);
    }
    CHECK_EQ_INT(res->shared, 6);
    ss_mdread_free(r);
    free(buf);
}

/* A fold hook: takes list batches of (int, int) tuples as rows of pairs;
 * with all set, takes any batch (rows of nothing). */
typedef struct rows {
    int64_t v[2 * 4096];
    uint32_t n;
    int all;
    int calls;
} rows;

static int take_pairs(void *ctx, const ss_md_result *t, uint32_t ci,
                      const uint32_t *items, size_t n, uint32_t *row0)
{
    rows *r = ctx;
    r->calls++;
    if (r->all) {
        *row0 = r->n;
        r->n += (uint32_t)(t->nodes[ci].kind == SS_MD_DICT ? n / 2 : n);
        return 1;
    }
    if (t->nodes[ci].kind != SS_MD_LIST || r->n + n > 4096)
        return 0;
    for (size_t k = 0; k < n; k++) {
        const ss_md_node *x = &t->nodes[items[k]];
        if (items[k] & SS_MD_ROW_BIT || x->kind != SS_MD_TUPLE || x->b != 2)
            return 0;
        for (int j = 0; j < 2; j++)
            if (t->nodes[t->kids[x->a + j]].kind != SS_MD_INT)
                return 0;
    }
    *row0 = r->n;
    for (size_t k = 0; k < n; k++) {
        const ss_md_node *x = &t->nodes[items[k]];
        for (int j = 0; j < 2; j++)
            r->v[2 * r->n + j] = ival(&t->nodes[t->kids[x->a + j]]);
        r->n++;
    }
    return 1;
}

static int dec_fold(const char *s, size_t n, rows *rw, ss_mdread **r,
                    char **keep)
{
    ss_md_fold f = {take_pairs, rw};
    *keep = malloc(n);
    memcpy(*keep, s, n);
    return ss_mdread_decode_fold(*keep, n, &f, r, NULL);
}

static void test_fold_rows(void)
{
    /* ([(i, i + 300) for i in range(2500)], (300, 301)): three APPENDS
     * batches, each tuple memoized and never fetched: all folded, the
     * nodes dropped (the int cache's too: 300 and 301 come again) */
    char *s = malloc(3 + 2500 * 8 + 6 + 10), *p = s;
    rows rw = {0};
    memcpy(p, "\x80\x04]", 3);
    p += 3;
    for (int i = 0; i < 2500; i++) {
        if (i % 1000 == 0)
            *p++ = '(';
        *p++ = 'M';
        *p++ = (char)(i & 0xff);
        *p++ = (char)(i >> 8);
        *p++ = 'M';
        *p++ = (char)((i + 300) & 0xff);
        *p++ = (char)((i + 300) >> 8);
        *p++ = '\x86';
        *p++ = '\x94';
        if (i % 1000 == 999 || i == 2499)
            *p++ = 'e';
    }
    memcpy(p, "M\x2c\x01M\x2d\x01\x86\x86.", 10);
    p += 10;
    ss_mdread *r;
    char *keep;
    CHECK_EQ_INT(dec_fold(s, (size_t)(p - s), &rw, &r, &keep), 0);
    if (r != NULL) {
        const ss_md_result *res = ss_mdread_result(r);
        const ss_md_node *root = node(res, res->root), *l, *t;
        l = node(res, res->kids[root->a]);
        t = node(res, res->kids[root->a + 1]);
        CHECK_EQ_INT(rw.calls, 3);
        CHECK_EQ_INT(rw.n, 2500);
        CHECK(res->nnodes < 300); /* the fixed ones and a few */
        CHECK_EQ_INT(l->b, 2500);
        for (uint32_t i = 0; i < 2500 && l->b == 2500; i++) {
            uint32_t k = res->kids[l->a + i];
            CHECK(k == (i | SS_MD_ROW_BIT));
            CHECK(rw.v[2 * i] == i && rw.v[2 * i + 1] == i + 300);
        }
        CHECK_EQ_INT(t->kind, SS_MD_TUPLE);
        CHECK_EQ_INT(ival(node(res, res->kids[t->a])), 300);
        CHECK_EQ_INT(ival(node(res, res->kids[t->a + 1])), 301);
        ss_mdread_free(r);
    }
    free(keep);
    free(s);
}

static void test_fold_refused(void)
{
    /* a batch whose tuple is fetched later: kept */
    static const char pinned[] = "\x80\x04](K\x01K\x02\x86\x94"
                                 "eh\x00\x86.";
    /* a batch whose item is an older object given a newer state (BUILD):
     * kept (the state would be dropped under it) */
    static const char built[] = "\x80\x04\x8c\x01m\x8c\x01"
                                "C\x93)\x81\x94](h\x00]be\x86.";
    rows rw = {0};
    ss_mdread *r;
    char *keep;
    rw.all = 1;
    CHECK_EQ_INT(dec_fold(S(pinned), &rw, &r, &keep), 0);
    if (r != NULL) {
        const ss_md_result *res = ss_mdread_result(r);
        const ss_md_node *root = node(res, res->root);
        const ss_md_node *l = node(res, res->kids[root->a]);
        CHECK_EQ_INT(rw.calls, 0);
        CHECK_EQ_INT(l->b, 1);
        CHECK_EQ_INT(res->kids[l->a], res->kids[root->a + 1]);
        ss_mdread_free(r);
    }
    free(keep);
    CHECK_EQ_INT(dec_fold(S(built), &rw, &r, &keep), 0);
    if (r != NULL) {
        const ss_md_result *res = ss_mdread_result(r);
        const ss_md_node *root = node(res, res->root);
        const ss_md_node *o = node(res, res->kids[root->a]);
        const ss_md_node *l = node(res, res->kids[root->a + 1]);
        CHECK_EQ_INT(rw.calls, 0);
        CHECK_EQ_INT(o->kind, SS_MD_NEWOBJ);
        CHECK(o->c >= 1 && o->c - 1 < res->nnodes);
        CHECK_EQ_INT(node(res, o->c - 1)->kind, SS_MD_LIST);
        CHECK_EQ_INT(res->kids[l->a], res->kids[root->a]);
        ss_mdread_free(r);
    }
    free(keep);
}

int main(void)
{
    RUN(test_decodes_a_dict);
    RUN(test_ints_batches_memo_and_globals);
    RUN(test_path_reduce);
    RUN(test_refuses);
    RUN(test_truncations_and_flips);
    RUN(test_many_items);
    RUN(test_batches_after_a_run);
    RUN(test_batches_apart_and_together);
    RUN(test_memo_fetched_only);
    RUN(test_fold_rows);
    RUN(test_fold_refused);
    ss_mdread_free(NULL);
    return ss_test_report("test_mdread");
}
