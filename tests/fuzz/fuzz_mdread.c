/* fuzz_mdread.c - libFuzzer harness for ss_mdread_decode (csrc/core/
 * ss_mdread.c), the fast path's decoder of a .metadata read from disk.
 *
 * Built with -fsanitize=fuzzer,address,undefined (make fuzz): any read past
 * the input, leak or undefined behaviour is a crash. Beyond that it checks
 * what ss_mdread.h promises of an accepted stream, by walking the table
 * (iteratively, each node once):
 *  - decode returns 0, SS_EINVAL, SS_ERANGE or SS_ENOMEM; on failure no
 *    result, on success err untouched;
 *  - every node index (root, kids, a GLOBAL's strings, a NEWOBJ's or
 *    REDUCE's callable, arguments and state) names a node; every kids range
 *    lies inside kids; every string and bytes range inside the data; share
 *    slots within 1..shared; GLOBAL operands are strings, NEWOBJ/REDUCE
 *    arguments tuples; every node is reachable from the root (no POP);
 *  - the fast path runs only on what the scan (ss_pickle_scan) passes: an
 *    accepted stream without a cycle and nesting at most
 *    SS_PICKLE_DEPTH_MAX passes the scan too;
 *  - decode is deterministic: the same bytes give the same code and table
 *    size;
 *  - with a fold hook that takes every batch it is offered
 *    (ss_mdread_decode_fold), the answer is the same code, the table no
 *    larger, every reference in bounds and every row id one the hook gave
 *    (dropped nodes are never referred to again; ASan sees any use).
 * A violated property aborts, so libFuzzer keeps the input. */
#include "ss_mdread.h"
#include "ss_pickle.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond)                                                            \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "fuzz_mdread: %s failed (line %d)\n", #cond,       \
                    __LINE__);                                                 \
            abort();                                                           \
        }                                                                      \
    } while (0)

/* Rows the fold hook handed out in this input's folded decode. */
static uint32_t rows_made;

static int take_all(void *ctx, const ss_md_result *t, uint32_t ci,
                    const uint32_t *items, size_t n, uint32_t *row0)
{
    (void)ctx;
    CHECK(ci < t->nnodes && n > 0);
    CHECK(t->nodes[ci].kind == SS_MD_LIST || t->nodes[ci].kind == SS_MD_DICT);
    for (size_t k = 0; k < n; k++)
        CHECK((items[k] & SS_MD_ROW_BIT) || items[k] < t->nnodes);
    *row0 = rows_made;
    rows_made += (uint32_t)(t->nodes[ci].kind == SS_MD_DICT ? n / 2 : n);
    return 1;
}

static int is_container(unsigned kind)
{
    return kind == SS_MD_TUPLE || kind == SS_MD_LIST || kind == SS_MD_DICT;
}

/* Checks every reference of node i; pushes its children on stack. */
static void visit(const ss_md_result *r, size_t len, uint32_t i,
                  uint32_t *stack, size_t *sp)
{
    const ss_md_node *n = &r->nodes[i];
    CHECK(n->share <= r->shared);
    switch (n->kind) {
    case SS_MD_STR:
    case SS_MD_BYTES:
        CHECK(n->a <= len && n->b <= len - n->a);
        break;
    case SS_MD_TUPLE:
    case SS_MD_LIST:
    case SS_MD_DICT: {
        size_t cnt = n->kind == SS_MD_DICT ? 2 * (size_t)n->b : n->b;
        CHECK(cnt == 0 || (n->a <= r->nkids && cnt <= r->nkids - n->a));
        for (size_t k = 0; k < cnt; k++) {
            uint32_t kid = r->kids[n->a + k];
            if (kid & SS_MD_ROW_BIT) { /* only a fold's list or dict */
                CHECK(n->kind != SS_MD_TUPLE);
                CHECK((kid & ~SS_MD_ROW_BIT) < rows_made);
                continue;
            }
            CHECK(kid < r->nnodes);
            stack[(*sp)++] = kid;
        }
        break;
    }
    case SS_MD_GLOBAL:
        CHECK(n->a < r->nnodes && n->b < r->nnodes);
        CHECK(r->nodes[n->a].kind == SS_MD_STR);
        CHECK(r->nodes[n->b].kind == SS_MD_STR);
        stack[(*sp)++] = n->a;
        stack[(*sp)++] = n->b;
        break;
    case SS_MD_NEWOBJ:
    case SS_MD_REDUCE:
        CHECK(n->a < r->nnodes && n->b < r->nnodes);
        CHECK(r->nodes[n->b].kind == SS_MD_TUPLE);
        CHECK(n->c == 0 || n->c - 1 < r->nnodes);
        stack[(*sp)++] = n->a;
        stack[(*sp)++] = n->b;
        if (n->c)
            stack[(*sp)++] = n->c - 1;
        break;
    default:
        CHECK(n->kind <= SS_MD_FLOAT);
    }
}

/* Every reference of the table reachable from the root in bounds. */
static void walk(const ss_md_result *res, size_t len, uint8_t *seen)
{
    uint32_t *stack = malloc((res->nkids + 3 * res->nnodes + 1) * 4);
    size_t sp = 0;
    CHECK(seen != NULL && stack != NULL);
    stack[sp++] = res->root;
    while (sp) {
        uint32_t i = stack[--sp];
        CHECK(i < res->nnodes);
        if (seen[i])
            continue;
        seen[i] = 1;
        visit(res, len, i, stack, &sp);
    }
    free(stack);
}

/* Depth of the graph under i (containers and calls count 1), or -1 on a
 * cycle; memoised in depth[] (0: not yet, -2: on the path). Recursion is
 * bounded by the cap. */
static int depth_of(const ss_md_result *r, uint32_t i, int *depth, int cap)
{
    const ss_md_node *n = &r->nodes[i];
    int best = 0;
    if (depth[i] == -2)
        return -1;
    if (depth[i] > 0)
        return depth[i] - 1;
    if (cap == 0)
        return -1;
    depth[i] = -2;
    if (is_container(n->kind)) {
        size_t cnt = n->kind == SS_MD_DICT ? 2 * (size_t)n->b : n->b;
        for (size_t k = 0; k < cnt; k++) {
            int d = depth_of(r, r->kids[n->a + k], depth, cap - 1);
            if (d < 0)
                return -1;
            best = d + 1 > best ? d + 1 : best;
        }
    } else if (n->kind == SS_MD_NEWOBJ || n->kind == SS_MD_REDUCE) {
        uint32_t sub[3] = {n->a, n->b, n->c ? n->c - 1 : n->b};
        for (int k = 0; k < 3; k++) {
            int d = depth_of(r, sub[k], depth, cap - 1);
            if (d < 0)
                return -1;
            best = d + 1 > best ? d + 1 : best;
        }
    }
    depth[i] = best + 1;
    return best;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len)
{
    ss_mdread *r = NULL, *r2 = NULL;
    ss_errinfo err;
    int rc, rc2;

    ss_errinfo_clear(&err);
    rc = ss_mdread_decode(data, len, &r, &err);
    CHECK(rc == 0 || rc == SS_EINVAL || rc == SS_ERANGE || rc == SS_ENOMEM);
    rc2 = ss_mdread_decode(data, len, &r2, NULL);
    CHECK(rc2 == rc);
    if (rc < 0) {
        CHECK(r == NULL && r2 == NULL);
        CHECK(err.code == rc);
        return 0;
    }
    CHECK(err.code == 0);
    const ss_md_result *res = ss_mdread_result(r);
    CHECK(ss_mdread_result(r2)->nnodes == res->nnodes);
    CHECK(res->root < res->nnodes);
    CHECK(res->proto >= 3 && res->proto <= 5);

    /* every node reachable, every reference in bounds */
    uint8_t *seen = calloc(res->nnodes, 1);
    rows_made = 0;
    walk(res, len, seen);
    /* the fixed nodes (None, bools, small ints, ()) are made up front */
    for (size_t i = 0; i < res->nnodes; i++)
        CHECK(seen[i] || i < 3 + 256 + 1);

    int *depth = calloc(res->nnodes, sizeof *depth);
    CHECK(depth != NULL);
    int d = depth_of(res, res->root, depth, SS_PICKLE_DEPTH_MAX / 2);
    if (d >= 0)
        CHECK(ss_pickle_scan(data, len, NULL, NULL) == 0);
    free(depth);
    free(seen);
    ss_mdread_free(r2);

    /* folded: the same answer from a smaller table, nothing dangling */
    ss_md_fold fold = {take_all, NULL};
    rows_made = 0;
    CHECK(ss_mdread_decode_fold(data, len, &fold, &r2, NULL) == 0);
    const ss_md_result *f = ss_mdread_result(r2);
    CHECK(f->nnodes <= res->nnodes && f->root < f->nnodes);
    seen = calloc(f->nnodes, 1);
    walk(f, len, seen);
    free(seen);
    ss_mdread_free(r);
    ss_mdread_free(r2);
    return 0;
}
