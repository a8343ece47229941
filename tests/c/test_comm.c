/* test_comm.c - the NCCL communicator (ss_comm) on the stand-in libcudart
 * and libnccl (one-rank "communicators" whose collectives copy on the
 * host): the unique id, a communicator's life, the byte collectives with
 * and without waiting, the caller's stream ordered both ways, and the
 * errors (bad ranks, NCCL refusing a communicator) with NCCL's message. */
#include "ss_comm.h"
#include "ss_error.h"
#include "ss_test.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef SS_TEST_FAKE_DIR
#error "build with -DSS_TEST_FAKE_DIR=\"...\" (see the Makefile)"
#endif

static const ss_cuda *cu;
static const ss_nccl *nc;
static long (*waits)(void);

static void load(void)
{
    char a[SS_DL_PATH_MAX], b[SS_DL_PATH_MAX], why[SS_DL_REASON_MAX];
    snprintf(a, sizeof a, "%s/libfake_cudart_ok.so", SS_TEST_FAKE_DIR);
    snprintf(b, sizeof b, "%s/libfake_nccl_ok.so", SS_TEST_FAKE_DIR);
    const char *ca[] = {a}, *cb[] = {b};
    if (ss_cuda_load(ca, 1, &cu, why, sizeof why) != 0 ||
        ss_nccl_load(cb, 1, &nc, why, sizeof why) != 0) {
        fprintf(stderr, "cannot load the fakes: %s\n", why);
        exit(2);
    }
    waits = (long (*)(void))dlsym(cu->lib.handle, "fake_cuda_waits");
    if (waits == NULL)
        exit(2);
}

static void test_collectives(void)
{
    unsigned char id[SS_NCCL_UNIQUE_ID_BYTES];
    ss_comm *c = NULL;
    ss_errinfo e;
    unsigned char src[300], dst[300];
    CHECK_EQ_INT(ss_comm_unique_id(nc, id, &e), 0);
    CHECK(id[0] == 0x5a && id[127] == 0x5a);
    CHECK_EQ_INT(ss_comm_new(&c, nc, cu, 1, 1, 0, id, &e), 0);
    CHECK_EQ_INT(ss_comm_nranks(c), 1);
    CHECK_EQ_INT(ss_comm_rank(c), 0);
    CHECK_EQ_INT(ss_comm_device(c), 1);
    for (int i = 0; i < 300; i++)
        src[i] = (unsigned char)rnd();
    for (int wait = 0; wait < 2; wait++) {
        long w = waits();
        memset(dst, 0, sizeof dst);
        CHECK_EQ_INT(ss_comm_all_gather(c, src, dst, 300, NULL, wait, &e), 0);
        CHECK(memcmp(src, dst, 300) == 0);
        CHECK_EQ_INT(waits() - w, 2); /* ours after the caller's, and back */
        memcpy(dst, src, 300);
        CHECK_EQ_INT(ss_comm_broadcast(c, dst, 300, 0, NULL, wait, &e), 0);
        CHECK(memcmp(src, dst, 300) == 0);
        memset(dst, 0, sizeof dst);
        CHECK_EQ_INT(ss_comm_scatter(c, src, dst, 300, 0, NULL, wait, &e), 0);
        CHECK(memcmp(src, dst, 300) == 0);
        memset(dst, 0, sizeof dst);
        CHECK_EQ_INT(ss_comm_gather(c, src, dst, 300, 0, NULL, wait, &e), 0);
        CHECK(memcmp(src, dst, 300) == 0);
    }
    CHECK_EQ_INT(ss_comm_broadcast(c, dst, 300, 1, NULL, 1, &e), SS_EINVAL);
    CHECK_EQ_INT(ss_comm_all_gather(c, NULL, dst, 300, NULL, 1, &e), SS_EINVAL);
    CHECK_EQ_INT(ss_comm_all_gather(c, NULL, NULL, 0, NULL, 1, &e), 0);
    ss_comm_free(c);
    ss_comm_free(NULL);
}

static void test_refused(void)
{
    unsigned char id[SS_NCCL_UNIQUE_ID_BYTES];
    ss_comm *c = NULL;
    ss_errinfo e;
    memset(id, 0x5a, sizeof id);
    CHECK_EQ_INT(ss_comm_new(&c, nc, cu, 0, 2, 2, id, &e), SS_EINVAL);
    CHECK_EQ_INT(ss_comm_new(&c, nc, cu, -1, 1, 0, id, &e), SS_EINVAL);
    ss_errinfo_clear(&e);
    /* the fake NCCL makes one-rank communicators only */
    CHECK_EQ_INT(ss_comm_new(&c, nc, cu, 0, 2, 1, id, &e), SS_EDEVICE);
    CHECK(c == NULL);
    CHECK(strstr(e.detail,
                 "ncclCommInitRank: invalid argument (NCCL error 4)") != NULL);
    ss_errinfo_clear(&e);
    CHECK_EQ_INT(ss_comm_new(&c, nc, cu, 7, 1, 0, id, &e), SS_EDEVICE);
    CHECK(strstr(e.detail, "cudaSetDevice: invalid device ordinal") != NULL);
}

int main(void)
{
    load();
    RUN(test_collectives);
    RUN(test_refused);
    return ss_test_report("comm");
}
