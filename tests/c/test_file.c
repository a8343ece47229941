/* test_file.c - single-file operations (ss_file), the patch mode of a write
 * batch, and the fault injector's kill arm. */
#include "ss_error.h"
#include "ss_file.h"
#include "ss_io.h"
#include "ss_os.h"
#include "ss_test.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char dir[64];

static void put(const char *path, const char *data, size_t n)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0);
    CHECK_EQ_INT(write(fd, data, n), (long long)n);
    close(fd);
}

static void path_in(char *out, size_t n, const char *name)
{
    snprintf(out, n, "%s/%s", dir, name);
}

static void test_read_whole_file(void)
{
    char p[128];
    void *buf = NULL;
    uint64_t len = 0;
    ss_errinfo e;

    path_in(p, sizeof p, "meta");
    put(p, "hello, metadata", 15);
    CHECK_EQ_INT(ss_file_read(NULL, p, 1 << 20, &buf, &len, &e), 0);
    CHECK_EQ_INT(len, 15);
    CHECK(buf != NULL && memcmp(buf, "hello, metadata", 15) == 0);
    free(buf);
    /* larger than the limit, and empty: SS_ERANGE, nothing handed out */
    CHECK_EQ_INT(ss_file_read(NULL, p, 14, &buf, &len, &e), SS_ERANGE);
    CHECK(buf == NULL && len == 0);
    CHECK(strstr(e.detail, "15 bytes") != NULL);
    put(p, "", 0);
    CHECK_EQ_INT(ss_file_read(NULL, p, 100, &buf, &len, &e), SS_ERANGE);
    /* missing */
    path_in(p, sizeof p, "nope");
    CHECK_EQ_INT(ss_file_read(NULL, p, 100, &buf, &len, &e), -ENOENT);
    CHECK_EQ_INT(e.sys_errno, ENOENT);
    CHECK(strcmp(e.op, "open") == 0);
}

static void test_non_regular_refused(void)
{
    char fifo[128];
    void *buf = NULL;
    uint64_t len = 0;
    int64_t size = -1;
    void *addr = NULL;
    ss_errinfo e;
    int fds = count_fds();

    path_in(fifo, sizeof fifo, "fifo");
    CHECK_EQ_INT(mkfifo(fifo, 0600), 0);
    /* a FIFO with no writer: opened without blocking, then refused */
    CHECK_EQ_INT(ss_file_read(NULL, fifo, 100, &buf, &len, &e), SS_ENOTREG);
    CHECK_EQ_INT(ss_file_size(NULL, fifo, &size, &e), SS_ENOTREG);
    CHECK_EQ_INT(ss_file_map(NULL, fifo, &addr, &size, &e), SS_ENOTREG);
    CHECK(addr == NULL);
    /* a directory */
    CHECK_EQ_INT(ss_file_read(NULL, dir, 100, &buf, &len, &e), SS_ENOTREG);
    CHECK_EQ_INT(count_fds(), fds);
    unlink(fifo);
}

static void test_size_and_map(void)
{
    char p[128];
    int64_t size = -1;
    void *addr = NULL;
    ss_errinfo e;

    path_in(p, sizeof p, "data");
    put(p, "0123456789", 10);
    CHECK_EQ_INT(ss_file_size(NULL, p, &size, &e), 0);
    CHECK_EQ_INT(size, 10);
    CHECK_EQ_INT(ss_file_map(NULL, p, &addr, &size, &e), 0);
    CHECK(addr != NULL && size == 10 && memcmp(addr, "0123456789", 10) == 0);
    ss_file_unmap(NULL, addr, size);
    put(p, "", 0); /* an empty file maps to nothing, successfully */
    CHECK_EQ_INT(ss_file_map(NULL, p, &addr, &size, &e), 0);
    CHECK(addr == NULL && size == 0);
    ss_file_unmap(NULL, addr, size);
    unlink(p);
}

static void test_unlink_and_mkdirs(void)
{
    char p[128], q[160];
    ss_errinfo e;
    struct stat st;

    path_in(p, sizeof p, "gone");
    put(p, "x", 1);
    CHECK_EQ_INT(ss_file_unlink(NULL, p, 1, &e), 1);
    CHECK_EQ_INT(ss_file_unlink(NULL, p, 1, &e), 0);
    CHECK_EQ_INT(ss_file_unlink(NULL, p, 0, &e), -ENOENT);

    path_in(p, sizeof p, "a/b/c/");
    CHECK_EQ_INT(ss_file_mkdirs(NULL, p, &e), 0);
    CHECK(stat(p, &st) == 0 && S_ISDIR(st.st_mode));
    CHECK_EQ_INT(ss_file_mkdirs(NULL, p, &e), 0); /* exists: fine */
    CHECK_EQ_INT(ss_file_fsync_dir(NULL, p, &e), 0);
    /* a regular file in the way, at the end and in the middle */
    snprintf(q, sizeof q, "%s/a/f", dir);
    put(q, "x", 1);
    CHECK_EQ_INT(ss_file_mkdirs(NULL, q, &e), -EEXIST);
    snprintf(q, sizeof q, "%s/a/f/g/h", dir);
    CHECK(ss_file_mkdirs(NULL, q, &e) < 0);
    snprintf(q, sizeof q, "%s/a/f", dir);
    unlink(q);
}

static void rm_tree_abc(void)
{
    char p[128];
    path_in(p, sizeof p, "a/b/c");
    rmdir(p);
    path_in(p, sizeof p, "a/b");
    rmdir(p);
    path_in(p, sizeof p, "a");
    rmdir(p);
}

/* Every operation of every function failing in turn: the error comes back,
 * no descriptor or mapping is left behind. */
static void test_faults_reach_every_call(void)
{
    char p[128], d[128];
    ss_faults *f;
    ss_errinfo e;
    int fds;

    rm_tree_abc();
    path_in(p, sizeof p, "meta");
    put(p, "0123456789abcdef", 16);
    path_in(d, sizeof d, "x/y");
    CHECK_EQ_INT(ss_faults_new(&f, NULL), 0);
    fds = count_fds();
    for (int op = 0; op < SS_OS_NOPS; op++) {
        void *buf = NULL, *addr = NULL;
        uint64_t len = 0;
        int64_t size = 0;
        int rc;

        ss_faults_reset(f);
        CHECK_EQ_INT(ss_faults_fail(f, op, 1, EIO), 0);
        rc = ss_file_read(ss_faults_os(f), p, 100, &buf, &len, &e);
        if (op == SS_OS_OPEN || op == SS_OS_FSIZE || op == SS_OS_PREAD ||
            op == SS_OS_CLOSE) {
            CHECK_EQ_INT(rc, -EIO);
            CHECK(buf == NULL);
        } else {
            CHECK_EQ_INT(rc, 0);
            free(buf);
        }
        ss_faults_reset(f);
        CHECK_EQ_INT(ss_faults_fail(f, op, 1, EIO), 0);
        rc = ss_file_map(ss_faults_os(f), p, &addr, &size, &e);
        CHECK_EQ_INT(rc, op == SS_OS_OPEN || op == SS_OS_FSIZE ||
                                 op == SS_OS_MMAP || op == SS_OS_CLOSE
                             ? -EIO
                             : 0);
        CHECK(rc == 0 || addr == NULL);
        ss_file_unmap(NULL, addr, size);
        ss_faults_reset(f);
        CHECK_EQ_INT(ss_faults_fail(f, op, 1, ENOSPC), 0);
        rc = ss_file_mkdirs(ss_faults_os(f), d, &e);
        /* an open looks at the existing parents */
        CHECK_EQ_INT(rc, op == SS_OS_MKDIR || op == SS_OS_OPEN ? -ENOSPC : 0);
        rmdir(d);
        path_in(d, sizeof d, "x");
        rmdir(d);
        path_in(d, sizeof d, "x/y");
    }
    /* the probe for growth (the second pread) failing is that failure,
     * not "the file grew" */
    ss_faults_reset(f);
    CHECK_EQ_INT(ss_faults_fail(f, SS_OS_PREAD, 2, ENOSPC), 0);
    {
        void *buf = NULL;
        uint64_t len = 0;
        CHECK_EQ_INT(ss_file_read(ss_faults_os(f), p, 100, &buf, &len, &e),
                     -ENOSPC);
        CHECK(buf == NULL && e.job == -1 && e.offset == 16);
    }
    /* short reads and EINTR are absorbed */
    ss_faults_reset(f);
    CHECK_EQ_INT(ss_faults_short(f, SS_OS_PREAD, 1, 3), 0);
    CHECK_EQ_INT(ss_faults_eintr(f, SS_OS_OPEN, 1), 0);
    {
        void *buf = NULL;
        uint64_t len = 0;
        CHECK_EQ_INT(ss_file_read(ss_faults_os(f), p, 100, &buf, &len, &e), 0);
        CHECK(len == 16 && memcmp(buf, "0123456789abcdef", 16) == 0);
        free(buf);
    }
    CHECK_EQ_INT(count_fds(), fds);
    ss_faults_free(f);
    unlink(p);
}

/* patch: existing files are written in place, size and other bytes kept;
 * a file with no job is only fsynced; a missing file is ENOENT. */
static void test_patch_mode(void)
{
    char p[128], q[128], r[128];
    const char *paths[3];
    ss_io_opts o = SS_IO_OPTS_INIT;
    ss_io_wjob job;
    ss_errinfo e;
    ss_faults *f;
    char got[16];
    int fd;

    path_in(p, sizeof p, "rec");
    path_in(q, sizeof q, "other");
    path_in(r, sizeof r, "missing");
    put(p, "header-DATA-trailer", 19);
    put(q, "kept", 4);
    paths[0] = p;
    paths[1] = q;
    job = (ss_io_wjob){"TRAIL", 5, 0, 12, 0};
    o.patch = 1;
    o.fsync = 1;
    CHECK_EQ_INT(ss_faults_new(&f, NULL), 0);
    CHECK_EQ_INT(
        ss_io_write(ss_faults_os(f), NULL, paths, 2, &job, 1, &o, NULL, &e), 0);
    CHECK_EQ_INT(ss_faults_calls(f, SS_OS_FSYNC), 2);
    CHECK_EQ_INT(ss_faults_calls(f, SS_OS_FTRUNCATE), 0);
    fd = open(p, O_RDONLY);
    CHECK_EQ_INT(read(fd, got, sizeof got), 16);
    close(fd);
    CHECK(memcmp(got, "header-DATA-TRAIL", 16) == 0);
    fd = open(q, O_RDONLY);
    CHECK_EQ_INT(read(fd, got, sizeof got), 4);
    close(fd);
    paths[1] = r;
    CHECK_EQ_INT(ss_io_write(NULL, NULL, paths, 2, &job, 1, &o, NULL, &e),
                 -ENOENT);
    CHECK(access(r, F_OK) != 0);
    /* without patch, a file with no job is created empty */
    o.patch = 0;
    CHECK_EQ_INT(ss_io_write(NULL, NULL, paths + 1, 1, NULL, 0, &o, NULL, &e),
                 0);
    CHECK(access(r, F_OK) == 0);
    ss_faults_free(f);
    unlink(p);
    unlink(q);
    unlink(r);
}

/* The kill arm: the process dies by SIGKILL at exactly that call, and the
 * call is not made. */
static void test_kill_arm(void)
{
    char p[128];
    pid_t pid;
    int status = 0;

    path_in(p, sizeof p, "killed");
    put(p, "old", 3);
    fflush(NULL);
    pid = fork();
    if (pid == 0) {
        ss_faults *f;
        if (ss_faults_new(&f, NULL) < 0 ||
            ss_faults_kill(f, SS_OS_RENAME, 1) < 0)
            _exit(3);
        ss_file_publish(ss_faults_os(f), p, "new", 3, 1, NULL);
        _exit(0); /* not reached */
    }
    CHECK(pid > 0);
    CHECK_EQ_INT(waitpid(pid, &status, 0), pid);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    {
        char got[4] = {0};
        int fd = open(p, O_RDONLY);
        CHECK_EQ_INT(read(fd, got, 3), 3);
        close(fd);
        CHECK(memcmp(got, "old", 3) == 0); /* the rename never happened */
    }
    /* the temp file is what a crash leaves; remove it and the target */
    {
        DIR *d = opendir(dir);
        struct dirent *de;
        int tmps = 0;
        while (d != NULL && (de = readdir(d)) != NULL) {
            if (strstr(de->d_name, ".killed.") == de->d_name) {
                char t[400];
                snprintf(t, sizeof t, "%s/%s", dir, de->d_name);
                unlink(t);
                tmps++;
            }
        }
        if (d != NULL)
            closedir(d);
        CHECK_EQ_INT(tmps, 1);
    }
    unlink(p);
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/ss_test_file.XXXXXX");
    if (mkdtemp(dir) == NULL)
        return 2;
    RUN(test_read_whole_file);
    RUN(test_non_regular_refused);
    RUN(test_size_and_map);
    RUN(test_unlink_and_mkdirs);
    RUN(test_faults_reach_every_call);
    RUN(test_patch_mode);
    RUN(test_kill_arm);
    rm_tree_abc();
    rmdir(dir);
    return ss_test_report("file");
}
