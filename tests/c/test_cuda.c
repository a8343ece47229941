/* test_cuda.c - the run-time loaders of libcudart and libnccl (ss_dl,
 * ss_cuda, ss_nccl) against missing files, non-libraries and the stand-in
 * libraries the Makefile builds from tests/c/fake_*.c into SS_TEST_FAKE_DIR:
 * versions reported, too-old versions refused, a missing symbol named, the
 * candidate order, one table per library file (also across threads), and
 * calls through the table reaching the library. No GPU is needed. */
#include "ss_cuda.h"
#include "ss_error.h"
#include "ss_nccl.h"
#include "ss_test.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef SS_TEST_FAKE_DIR
#error "build with -DSS_TEST_FAKE_DIR=\"...\" (see the Makefile)"
#endif

static char tmpdir[] = "/tmp/ss_test_cuda_XXXXXX";

static const char *fake(const char *name)
{
    static char buf[8][SS_DL_PATH_MAX];
    static int k;
    char *p = buf[k++ % 8];
    snprintf(p, SS_DL_PATH_MAX, "%s/libfake_%s.so", SS_TEST_FAKE_DIR, name);
    return p;
}

static int contains(const char *hay, const char *needle)
{
    int ok = strstr(hay, needle) != NULL;
    if (!ok)
        fprintf(stderr, "  expected \"%s\" in \"%s\"\n", needle, hay);
    return ok;
}

static int ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

static void test_missing_path(void)
{
    const char *c[] = {"/nonexistent/dir/libcudart.so.99"};
    ss_cuda_status st;
    int rc = ss_cuda_probe(c, 1, &st);
    CHECK_EQ_INT(rc, SS_ENOTAVAIL);
    CHECK(!st.loaded && !st.available);
    CHECK_EQ_INT(st.runtime_version, 0);
    CHECK(st.path[0] == '\0');
    CHECK(contains(
        st.reason,
        "libcudart not found: tried /nonexistent/dir/libcudart.so.99"));

    const char *n[] = {"/nonexistent/libnccl.so.2", "/also/missing/libnccl.so"};
    ss_nccl_status ns;
    CHECK_EQ_INT(ss_nccl_probe(n, 2, &ns), SS_ENOTAVAIL);
    CHECK(!ns.loaded);
    CHECK(contains(ns.reason,
                   "libnccl not found: tried /nonexistent/libnccl.so.2, "
                   "/also/missing/libnccl.so"));
}

static void test_not_a_library(void)
{
    char path[256];
    snprintf(path, sizeof path, "%s/libcudart.so", tmpdir);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f == NULL)
        return;
    fputs("this is not an ELF file\n", f);
    fclose(f);
    const char *c[] = {path};
    ss_cuda_status st;
    CHECK_EQ_INT(ss_cuda_probe(c, 1, &st), SS_ENOTAVAIL);
    CHECK(contains(st.reason, "libcudart not usable: tried "));
    CHECK(contains(st.reason, path));
    CHECK(strstr(st.reason, "not found") == NULL);
}

static void test_fake_cudart_loads(void)
{
    const char *c[] = {fake("cudart_ok")};
    ss_cuda_status st;
    int rc = ss_cuda_probe(c, 1, &st);
    CHECK_EQ_INT(rc, 0);
    CHECK(st.loaded && st.available);
    CHECK_EQ_INT(st.runtime_version, 12040);
    CHECK_EQ_INT(st.driver_version, 12040);
    CHECK_EQ_INT(st.device_count, 2);
    CHECK_EQ_INT(st.device_error, 0);
    CHECK(ends_with(st.path, "/libfake_cudart_ok.so"));
    CHECK(st.path[0] == '/');
    CHECK(st.reason[0] == '\0');

    /* Calls through the table reach the library. */
    const ss_cuda *cu = NULL;
    CHECK_EQ_INT(ss_cuda_load(c, 1, &cu, NULL, 0), 0);
    if (cu == NULL)
        return;
    int n = -1;
    CHECK_EQ_INT(cu->cudaGetDeviceCount(&n), 0);
    CHECK_EQ_INT(n, 2);
    CHECK_EQ_INT(cu->cudaSetDevice(1), 0);
    int d = -1;
    CHECK_EQ_INT(cu->cudaGetDevice(&d), 0);
    CHECK_EQ_INT(d, 1);
    CHECK_EQ_INT(cu->cudaSetDevice(7), 101);
    CHECK(strcmp(cu->cudaGetErrorString(101), "invalid device ordinal") == 0);
    void *pinned = NULL;
    CHECK_EQ_INT(cu->cudaHostAlloc(&pinned, 64, SS_CUDA_HOST_ALLOC_PORTABLE),
                 0);
    ss_cudaStream_t s = NULL;
    CHECK_EQ_INT(cu->cudaStreamCreateWithFlags(&s, SS_CUDA_STREAM_NON_BLOCKING),
                 0);
    CHECK_EQ_INT(cu->cudaMemcpyAsync(pinned, "0123456789", 11,
                                     SS_CUDA_MEMCPY_DEVICE_TO_HOST, s),
                 0);
    CHECK_EQ_INT(cu->cudaStreamSynchronize(s), 0);
    CHECK(pinned != NULL && strcmp(pinned, "0123456789") == 0);
    CHECK_EQ_INT(cu->cudaFreeHost(pinned), 0);
    ss_cudaPointerAttributes attr;
    memset(&attr, 0xff, sizeof attr);
    CHECK_EQ_INT(cu->cudaPointerGetAttributes(&attr, &n), 0);
    CHECK_EQ_INT(attr.type, SS_CUDA_MEMORY_TYPE_UNREGISTERED);
}

static void test_same_table_once(void)
{
    const char *c[] = {fake("cudart_ok")};
    const ss_cuda *a = NULL, *b = NULL, *l = NULL;
    char link[256];
    CHECK_EQ_INT(ss_cuda_load(c, 1, &a, NULL, 0), 0);
    CHECK_EQ_INT(ss_cuda_load(c, 1, &b, NULL, 0), 0);
    CHECK(a != NULL && a == b);
    /* Another name for the same file: the dynamic linker hands back the
     * same object, so the loader hands back the same table. */
    snprintf(link, sizeof link, "%s/libcudart.so.12", tmpdir);
    CHECK_EQ_INT(symlink(c[0], link), 0);
    const char *viasym[] = {link};
    CHECK_EQ_INT(ss_cuda_load(viasym, 1, &l, NULL, 0), 0);
    CHECK(l == a);
    CHECK(a != NULL && ends_with(a->lib.path, "/libfake_cudart_ok.so"));
}

#define NTHREADS 8
static const ss_cuda *thread_result[NTHREADS];
static const char *thread_cands[1];

static void *load_thread(void *arg)
{
    size_t i = (size_t)arg;
    if (ss_cuda_load(thread_cands, 1, &thread_result[i], NULL, 0) != 0)
        thread_result[i] = NULL;
    return NULL;
}

static void test_concurrent_first_load(void)
{
    /* A variant nothing else loads, so the threads race on the first load. */
    pthread_t t[NTHREADS];
    char copy[256], cmd[600];
    snprintf(copy, sizeof copy, "%s/copy_cudart.so", tmpdir);
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", fake("cudart_ok"), copy);
    CHECK_EQ_INT(system(cmd), 0);
    thread_cands[0] = copy;
    for (size_t i = 0; i < NTHREADS; i++)
        CHECK_EQ_INT(pthread_create(&t[i], NULL, load_thread, (void *)i), 0);
    for (size_t i = 0; i < NTHREADS; i++)
        pthread_join(t[i], NULL);
    for (size_t i = 0; i < NTHREADS; i++) {
        CHECK(thread_result[i] != NULL);
        CHECK(thread_result[i] == thread_result[0]);
    }
    CHECK(thread_result[0] != NULL &&
          ends_with(thread_result[0]->lib.path, "/copy_cudart.so"));
}

static void test_old_runtime_refused(void)
{
    const char *c[] = {fake("cudart_old")};
    ss_cuda_status st;
    CHECK_EQ_INT(ss_cuda_probe(c, 1, &st), SS_ENOTAVAIL);
    CHECK(!st.loaded);
    CHECK(contains(st.reason, "libcudart not usable: tried "));
    CHECK(contains(st.reason, "libfake_cudart_old.so"));
    CHECK(contains(st.reason,
                   "CUDA runtime 10.2 is older than the minimum 11.0"));
}

static void test_missing_symbol_named(void)
{
    const char *c[] = {fake("cudart_nosym")};
    ss_cuda_status st;
    CHECK_EQ_INT(ss_cuda_probe(c, 1, &st), SS_ENOTAVAIL);
    CHECK(!st.loaded);
    CHECK(contains(st.reason, "(missing symbol cudaEventQuery)"));

    /* The wrong library altogether: every NCCL symbol is named. */
    const char *n[] = {fake("cudart_ok")};
    ss_nccl_status ns;
    CHECK_EQ_INT(ss_nccl_probe(n, 1, &ns), SS_ENOTAVAIL);
    CHECK(contains(ns.reason,
                   "missing symbols ncclGetVersion, ncclGetUniqueId, "));
    CHECK(contains(ns.reason, "ncclRecv)"));
}

static void test_no_device(void)
{
    const char *c[] = {fake("cudart_nodev")};
    ss_cuda_status st;
    CHECK_EQ_INT(ss_cuda_probe(c, 1, &st), SS_ENOTAVAIL);
    CHECK(st.loaded && !st.available);
    CHECK_EQ_INT(st.runtime_version, 12040);
    CHECK_EQ_INT(st.device_count, 0);
    CHECK_EQ_INT(st.device_error, SS_CUDA_ERROR_NO_DEVICE);
    CHECK(ends_with(st.path, "/libfake_cudart_nodev.so"));
    CHECK(contains(st.reason, "no CUDA device: cudaGetDeviceCount returned 100 "
                              "(no CUDA-capable device is detected)"));
}

static void test_candidate_order(void)
{
    const char *c[] = {"/nonexistent/libcudart.so", fake("cudart_nosym"),
                       fake("cudart_old"), fake("cudart_ok")};
    ss_cuda_status st;
    CHECK_EQ_INT(ss_cuda_probe(c, 4, &st), 0);
    CHECK(ends_with(st.path, "/libfake_cudart_ok.so"));

    ss_cuda_status bad;
    CHECK_EQ_INT(ss_cuda_probe(c, 3, &bad), SS_ENOTAVAIL);
    CHECK(contains(bad.reason,
                   "libcudart not usable: tried /nonexistent/libcudart.so, "));
    CHECK(
        contains(bad.reason,
                 "libfake_cudart_nosym.so (missing symbol cudaEventQuery), "));
    CHECK(contains(bad.reason,
                   "libfake_cudart_old.so (CUDA runtime 10.2 is older"));
}

static void test_bad_arguments(void)
{
    const char *c[] = {""};
    const ss_cuda *cu = (const ss_cuda *)1;
    char why[128];
    CHECK_EQ_INT(ss_cuda_load(c, 0, &cu, why, sizeof why), SS_EINVAL);
    CHECK(cu == NULL);
    CHECK(contains(why, "no candidate"));
    CHECK_EQ_INT(ss_cuda_load(c, 1, &cu, why, sizeof why), SS_EINVAL);
    CHECK(contains(why, "empty candidate"));
}

static void test_reason_truncated(void)
{
    const char *c[40];
    char names[40][64];
    char small[100];
    const ss_cuda *cu;
    for (int i = 0; i < 40; i++) {
        snprintf(names[i], sizeof names[i],
                 "/nonexistent/long/dir/name/libcudart.so.%d", i);
        c[i] = names[i];
    }
    ss_cuda_status st;
    CHECK_EQ_INT(ss_cuda_probe(c, 40, &st), SS_ENOTAVAIL);
    CHECK(strlen(st.reason) == sizeof st.reason - 1);
    CHECK(ends_with(st.reason, "..."));
    CHECK_EQ_INT(ss_cuda_load(c, 40, &cu, small, sizeof small), SS_ENOTAVAIL);
    CHECK(strlen(small) == sizeof small - 1);
    CHECK(ends_with(small, "..."));
    CHECK_EQ_INT(ss_cuda_load(c, 40, &cu, small, 1), SS_ENOTAVAIL);
    CHECK(small[0] == '\0');
}

static void test_fake_nccl(void)
{
    const char *c[] = {fake("nccl_ok")};
    ss_nccl_status st;
    CHECK_EQ_INT(ss_nccl_probe(c, 1, &st), 0);
    CHECK(st.loaded);
    CHECK_EQ_INT(st.version, 22105);
    CHECK(ends_with(st.path, "/libfake_nccl_ok.so"));
    CHECK(st.reason[0] == '\0');

    const ss_nccl *nc = NULL;
    CHECK_EQ_INT(ss_nccl_load(c, 1, &nc, NULL, 0), 0);
    if (nc == NULL)
        return;
    ss_ncclUniqueId id;
    memset(&id, 0, sizeof id);
    CHECK_EQ_INT(nc->ncclGetUniqueId(&id), 0);
    CHECK(((unsigned char *)&id)[127] == 0x5a);
    ss_ncclComm_t comm = NULL;
    CHECK_EQ_INT(nc->ncclCommInitRank(&comm, 1, id, 0), 0);
    CHECK(comm != NULL);
    CHECK_EQ_INT(nc->ncclCommInitRank(&comm, 2, id, 0), 4);
    float src[4] = {1, 2, 3, 4}, dst[4] = {0};
    CHECK_EQ_INT(nc->ncclGroupStart(), 0);
    CHECK_EQ_INT(nc->ncclAllGather(src, dst, 4, SS_NCCL_FLOAT32, comm, NULL),
                 0);
    CHECK_EQ_INT(nc->ncclGroupEnd(), 0);
    CHECK(memcmp(src, dst, sizeof src) == 0);
    ss_ncclResult_t async = 1;
    CHECK_EQ_INT(nc->ncclCommGetAsyncError(comm, &async), 0);
    CHECK_EQ_INT(async, SS_NCCL_SUCCESS);
    CHECK_EQ_INT(nc->ncclCommDestroy(comm), 0);
}

static void test_nccl_versions(void)
{
    CHECK_EQ_INT(ss_nccl_version_code(2804), 20804);
    CHECK_EQ_INT(ss_nccl_version_code(22105), 22105);
    CHECK_EQ_INT(ss_nccl_version_code(21200), 21200);
    CHECK_EQ_INT(ss_nccl_version_code(0), 0);

    const char *old[] = {fake("nccl_old")};
    ss_nccl_status st;
    CHECK_EQ_INT(ss_nccl_probe(old, 1, &st), SS_ENOTAVAIL);
    CHECK(contains(st.reason, "NCCL 2.11.5 is older than the minimum 2.12.0"));
    const char *oldenc[] = {fake("nccl_oldenc")};
    CHECK_EQ_INT(ss_nccl_probe(oldenc, 1, &st), SS_ENOTAVAIL);
    CHECK(contains(st.reason, "NCCL 2.8.4 is older than the minimum 2.12.0"));
    const char *nosym[] = {fake("nccl_nosym")};
    CHECK_EQ_INT(ss_nccl_probe(nosym, 1, &st), SS_ENOTAVAIL);
    CHECK(contains(st.reason, "(missing symbol ncclSend)"));
}

/* The default sonames: whatever this machine has, the answer is coherent. */
static void test_default_names(void)
{
    ss_cuda_status st;
    int rc = ss_cuda_probe(NULL, 0, &st);
    if (st.loaded) {
        CHECK(st.runtime_version >= SS_CUDA_MIN_RUNTIME);
        CHECK(strstr(st.path, "libcudart") != NULL);
        CHECK(rc == 0 ? st.device_count > 0
                      : contains(st.reason, "no CUDA device: "));
    } else {
        CHECK_EQ_INT(rc, SS_ENOTAVAIL);
        CHECK(contains(st.reason, "libcudart.so.13, libcudart.so.12, "
                                  "libcudart.so.11.0, libcudart.so"));
    }
    ss_nccl_status ns;
    rc = ss_nccl_probe(NULL, 0, &ns);
    if (ns.loaded)
        CHECK(rc == 0 && ns.version >= SS_NCCL_MIN_VERSION);
    else
        CHECK(contains(ns.reason, "libnccl.so.2, libnccl.so"));
}

int main(void)
{
    char cmd[128];
    if (mkdtemp(tmpdir) == NULL) {
        perror("mkdtemp");
        return 2;
    }
    RUN(test_missing_path);
    RUN(test_not_a_library);
    RUN(test_fake_cudart_loads);
    RUN(test_same_table_once);
    RUN(test_concurrent_first_load);
    RUN(test_old_runtime_refused);
    RUN(test_missing_symbol_named);
    RUN(test_no_device);
    RUN(test_candidate_order);
    RUN(test_bad_arguments);
    RUN(test_reason_truncated);
    RUN(test_fake_nccl);
    RUN(test_nccl_versions);
    RUN(test_default_names);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", tmpdir);
    return ss_test_report("cuda");
}
