/* io.c - batch file I/O entry points.
 *
 * write_batch/read_batch take the batch as flat positional arguments (paths,
 * per-job file indices, offsets and buffers), hold every Py_buffer for the
 * whole call and release the GIL around the whole batch; nothing here
 * touches a PyObject while it is released. Errors come back as a code plus
 * an ss_errinfo and become exceptions in ss_py_raise.
 *
 * A FaultInjector (faults.c) passed as `faults` routes the batch's system
 * calls through it.
 */
#include "module.h"
#include "ss_io.h"
#include "ss_recread.h"
#include "ss_recwrite.h"

#include <string.h>

/* ---- argument helpers --------------------------------------------------- */

/* A batch's converted arguments; everything is released by args_release. */
typedef struct {
    Py_ssize_t npaths, njobs, nviews;
    PyObject **fspaths; /* bytes from PyUnicode_FSConverter */
    const char **paths;
    int64_t *file_idx, *offsets;
    Py_buffer *views;  /* a CUDA job's holds its pointer and length only */
    PyObject *devrefs; /* list keeping CUDA jobs' objects alive, or NULL */
} batch_args;

static void args_release(batch_args *a)
{
    for (Py_ssize_t i = 0; a->views != NULL && i < a->nviews; i++)
        PyBuffer_Release(&a->views[i]);
    for (Py_ssize_t i = 0; a->fspaths != NULL && i < a->npaths; i++)
        Py_XDECREF(a->fspaths[i]);
    PyMem_Free(a->views);
    PyMem_Free(a->fspaths);
    PyMem_Free(a->paths);
    PyMem_Free(a->file_idx);
    PyMem_Free(a->offsets);
    Py_XDECREF(a->devrefs);
}

static int get_paths(PyObject *obj, batch_args *a)
{
    PyObject *seq = PySequence_Fast(obj, "paths must be a sequence");
    int rc = -1;

    if (seq == NULL)
        return -1;
    a->npaths = PySequence_Fast_GET_SIZE(seq);
    a->fspaths = PyMem_Calloc((size_t)a->npaths + 1, sizeof *a->fspaths);
    a->paths = PyMem_Calloc((size_t)a->npaths + 1, sizeof *a->paths);
    if (a->fspaths == NULL || a->paths == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < a->npaths; i++) {
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(seq, i),
                                   &a->fspaths[i]))
            goto out;
        a->paths[i] = PyBytes_AS_STRING(a->fspaths[i]);
    }
    rc = 0;
out:
    Py_DECREF(seq);
    return rc;
}

/* n int64 values from a 1-D int64 buffer (NumPy) or a sequence of ints. */
static int get_int64s(PyObject *obj, Py_ssize_t n, const char *what,
                      int64_t **out)
{
    Py_buffer v;
    PyObject *seq = NULL;
    int rc = -1;

    *out = PyMem_Malloc(((size_t)n + 1) * sizeof **out);
    if (*out == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (PyObject_CheckBuffer(obj) &&
        PyObject_GetBuffer(obj, &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
        const char *f = v.format != NULL ? v.format : "B";
        if (*f == '<' || *f == '=' || *f == '@')
            f++;
        if (v.ndim == 1 && v.itemsize == 8 &&
            (!strcmp(f, "q") || !strcmp(f, "l"))) {
            if (v.len / 8 != n)
                PyErr_Format(PyExc_ValueError,
                             "%s has %zd entries for %zd jobs", what, v.len / 8,
                             n);
            else
                memcpy(*out, v.buf, (size_t)n * 8);
            PyBuffer_Release(&v);
            return PyErr_Occurred() ? -1 : 0;
        }
        PyBuffer_Release(&v); /* another format: go through the items */
    }
    PyErr_Clear();
    seq = PySequence_Fast(obj, "");
    if (seq == NULL) {
        PyErr_Format(PyExc_TypeError,
                     "%s must be a sequence of ints or a 1-D int64 array, "
                     "not %.200s",
                     what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "%s has %zd entries for %zd jobs", what,
                     PySequence_Fast_GET_SIZE(seq), n);
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ix = PyNumber_Index(PySequence_Fast_GET_ITEM(seq, i));
        if (ix == NULL)
            goto out;
        (*out)[i] = PyLong_AsLongLong(ix);
        Py_DECREF(ix);
        if ((*out)[i] == -1 && PyErr_Occurred())
            goto out;
    }
    rc = 0;
out:
    Py_XDECREF(seq);
    return rc;
}

/* A CUDA job's buffer (see ss_py_cai_buffer): v->buf and v->len only;
 * v->obj stays NULL, the object is kept alive through a->devrefs. */
static int cuda_view(PyObject *item, Py_ssize_t i, int writable, Py_buffer *v,
                     batch_args *a)
{
    char what[32];
    void *ptr = NULL;
    Py_ssize_t len = 0;
    snprintf(what, sizeof what, "buffers[%zd]", i);
    if (ss_py_cai_buffer(item, what, writable, &ptr, &len) < 0)
        return -1;
    if (a->devrefs == NULL && (a->devrefs = PyList_New(0)) == NULL)
        return -1;
    if (PyList_Append(a->devrefs, item) < 0)
        return -1;
    memset(v, 0, sizeof *v);
    v->buf = ptr;
    v->len = len;
    return 0;
}

/* Hold a C-contiguous (and, if writable, writable) view of every buffer;
 * jobs with cuda[j] set are device buffers (__cuda_array_interface__). */
static int get_views(PyObject *obj, int writable, const char *cuda,
                     batch_args *a)
{
    PyObject *seq = PySequence_Fast(obj, "buffers must be a sequence");
    int rc = -1;

    if (seq == NULL)
        return -1;
    a->njobs = PySequence_Fast_GET_SIZE(seq);
    a->views = PyMem_Calloc((size_t)a->njobs + 1, sizeof *a->views);
    if (a->views == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < a->njobs; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        Py_buffer *v = &a->views[i];
        int flags = PyBUF_STRIDES | (writable ? PyBUF_WRITABLE : 0);
        if (cuda != NULL && cuda[i]) {
            if (cuda_view(item, i, writable, v, a) < 0)
                goto out;
            a->nviews++; /* released as an empty view: obj is NULL */
            continue;
        }
        if (!PyObject_CheckBuffer(item)) {
            PyErr_Format(PyExc_TypeError,
                         "buffers[%zd] must support the buffer protocol "
                         "(bytes, bytearray, memoryview, numpy array), "
                         "not %.200s",
                         i, Py_TYPE(item)->tp_name);
            goto out;
        }
        if (PyObject_GetBuffer(item, v, flags) < 0) {
            if (!writable)
                goto out;
            PyErr_Clear(); /* exporters differ: BufferError, ValueError */
            PyErr_Format(PyExc_BufferError,
                         "buffers[%zd] must be writable to read into it "
                         "(got a read-only %.200s)",
                         i, Py_TYPE(item)->tp_name);
            goto out;
        }
        a->nviews++;
        if (!PyBuffer_IsContiguous(v, 'C')) {
            PyErr_Format(PyExc_BufferError,
                         "buffers[%zd] must be C-contiguous (got a strided "
                         "%.200s)",
                         i, Py_TYPE(item)->tp_name);
            goto out;
        }
    }
    rc = 0;
out:
    Py_DECREF(seq);
    return rc;
}

/* paths, file_idx, offsets, buffers -> a; checks the indices. */
static int get_batch(PyObject *const *args, int writable, const char *cuda,
                     batch_args *a)
{
    if (get_paths(args[0], a) < 0 ||
        get_views(args[3], writable, cuda, a) < 0 ||
        get_int64s(args[1], a->njobs, "file_idx", &a->file_idx) < 0 ||
        get_int64s(args[2], a->njobs, "offsets", &a->offsets) < 0)
        return -1;
    for (Py_ssize_t j = 0; j < a->njobs; j++) {
        if (a->file_idx[j] < 0 || a->file_idx[j] >= a->npaths) {
            PyErr_Format(PyExc_IndexError,
                         "file_idx[%zd] = %lld is not a valid index into %zd "
                         "paths",
                         j, (long long)a->file_idx[j], a->npaths);
            return -1;
        }
        if (a->offsets[j] < 0) {
            PyErr_Format(PyExc_ValueError, "offsets[%zd] = %lld is negative", j,
                         (long long)a->offsets[j]);
            return -1;
        }
    }
    return 0;
}

static PyObject *crc_list(const uint32_t *crcs, Py_ssize_t n)
{
    PyObject *out = PyList_New(n);
    for (Py_ssize_t j = 0; out != NULL && j < n; j++) {
        PyObject *v = PyLong_FromUnsignedLong(crcs[j]);
        if (v == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, j, v);
    }
    return out;
}

static int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs == want)
        return 0;
    PyErr_Format(PyExc_TypeError,
                 "%s() takes %zd positional arguments (%zd "
                 "given)",
                 name, want, nargs);
    return -1;
}

/* piece argument: bytes per task, 0 = default. */
static int piece_arg(PyObject *obj, size_t *out)
{
    Py_ssize_t v = PyLong_AsSsize_t(obj);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0) {
        PyErr_SetString(PyExc_ValueError, "piece must be >= 0");
        return -1;
    }
    *out = (size_t)v;
    return 0;
}

/* device argument: None, or one truth value per job (its buffer is device
 * memory of the stage's backend; the "host" backend's is host memory, taken
 * through the buffer protocol like any other). njobs is len(buffers). */
static int dev_flags_arg(PyObject *obj, PyObject *buffers, ss_stage *stage,
                         char **out)
{
    PyObject *seq = NULL;
    Py_ssize_t njobs = PySequence_Size(buffers);
    int rc = -1;

    *out = NULL;
    if (njobs < 0) {
        PyErr_Clear();
        njobs = 0; /* get_views reports a non-sequence */
    }

    *out = PyMem_Calloc((size_t)njobs + 1, 1);
    if (*out == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (obj == Py_None)
        return 0;
    seq = PySequence_Fast(obj, "device must be a sequence of bools or None");
    if (seq == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(seq) != njobs) {
        PyErr_Format(PyExc_ValueError, "device has %zd entries for %zd jobs",
                     PySequence_Fast_GET_SIZE(seq), njobs);
        goto out;
    }
    for (Py_ssize_t j = 0; j < njobs; j++) {
        int v = PyObject_IsTrue(PySequence_Fast_GET_ITEM(seq, j));
        if (v < 0)
            goto out;
        if (v && stage == NULL) {
            PyErr_Format(PyExc_ValueError,
                         "device[%zd] is set but no stage was given", j);
            goto out;
        }
        (*out)[j] = (char)v;
    }
    rc = 0;
out:
    Py_DECREF(seq);
    return rc;
}

/* ---- entry points ------------------------------------------------------- */

static PyObject *py_write_batch(PyObject *m, PyObject *const *args,
                                Py_ssize_t nargs)
{
    ss_state *st = ss_get_state(m);
    batch_args a = {0};
    ss_io_opts o = SS_IO_OPTS_INIT;
    ss_io_wjob *jobs = NULL;
    uint32_t *crcs = NULL;
    char *dev = NULL;
    const ss_os *os = NULL;
    ss_pool *pool = NULL;
    ss_errinfo info;
    PyObject *result = NULL;
    int rc, cuda = 0;

    if (check_nargs("write_batch", nargs, 14) < 0 ||
        ss_py_stage_arg(st, args[10], &o.stage, &cuda) < 0 ||
        dev_flags_arg(args[11], args[3], o.stage, &dev) < 0 ||
        ss_py_stream_arg(args[12], &o.stream) < 0 ||
        get_batch(args, 0, cuda ? dev : NULL, &a) < 0 ||
        ss_py_pool_arg(st, args[4], &pool) < 0 ||
        (o.fsync = PyObject_IsTrue(args[5])) < 0 ||
        (o.checksum = PyObject_IsTrue(args[6])) < 0 ||
        piece_arg(args[7], &o.piece) < 0 ||
        ss_py_faults_arg(st, args[8], &os) < 0 ||
        (o.writeback = PyObject_IsTrue(args[9])) < 0 ||
        (o.patch = PyObject_IsTrue(args[13])) < 0)
        goto out;
    jobs = PyMem_Malloc(((size_t)a.njobs + 1) * sizeof *jobs);
    crcs = PyMem_Malloc(((size_t)a.njobs + 1) * sizeof *crcs);
    if (jobs == NULL || crcs == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t j = 0; j < a.njobs; j++)
        jobs[j] = (ss_io_wjob){a.views[j].buf, (uint64_t)a.views[j].len,
                               (uint32_t)a.file_idx[j], a.offsets[j], dev[j]};
    Py_BEGIN_ALLOW_THREADS
        rc = ss_io_write(os, pool, a.paths, (size_t)a.npaths, jobs,
                         (size_t)a.njobs, &o, crcs, &info);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        ss_py_raise(st, rc, &info);
    else
        result = crc_list(crcs, a.njobs);
out:
    PyMem_Free(jobs);
    PyMem_Free(crcs);
    PyMem_Free(dev);
    args_release(&a);
    return result;
}

static PyObject *py_read_batch(PyObject *m, PyObject *const *args,
                               Py_ssize_t nargs)
{
    ss_state *st = ss_get_state(m);
    batch_args a = {0};
    ss_io_opts o = SS_IO_OPTS_INIT;
    ss_io_rjob *jobs = NULL;
    uint32_t *crcs = NULL;
    char *dev = NULL;
    const ss_os *os = NULL;
    ss_pool *pool = NULL;
    PyObject *expected = NULL, *result = NULL;
    ss_errinfo info;
    int rc, cuda = 0;

    if (check_nargs("read_batch", nargs, 12) < 0 ||
        ss_py_stage_arg(st, args[10], &o.stage, &cuda) < 0 ||
        dev_flags_arg(args[11], args[3], o.stage, &dev) < 0 ||
        get_batch(args, 1, cuda ? dev : NULL, &a) < 0 ||
        ss_py_pool_arg(st, args[5], &pool) < 0 ||
        (o.verify = PyObject_IsTrue(args[6])) < 0 ||
        (o.checksum = PyObject_IsTrue(args[7])) < 0 ||
        piece_arg(args[8], &o.piece) < 0 ||
        ss_py_faults_arg(st, args[9], &os) < 0)
        goto out;
    jobs = PyMem_Malloc(((size_t)a.njobs + 1) * sizeof *jobs);
    crcs = PyMem_Malloc(((size_t)a.njobs + 1) * sizeof *crcs);
    if (jobs == NULL || crcs == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t j = 0; j < a.njobs; j++)
        jobs[j] = (ss_io_rjob){a.views[j].buf,
                               (uint64_t)a.views[j].len,
                               (uint32_t)a.file_idx[j],
                               a.offsets[j],
                               0,
                               0,
                               dev[j]};
    if (args[4] != Py_None) { /* expected CRCs: ints, or None to skip one */
        expected = PySequence_Fast(args[4], "crcs must be a sequence or None");
        if (expected == NULL)
            goto out;
        if (PySequence_Fast_GET_SIZE(expected) != a.njobs) {
            PyErr_Format(PyExc_ValueError, "crcs has %zd entries for %zd jobs",
                         PySequence_Fast_GET_SIZE(expected), a.njobs);
            goto out;
        }
        for (Py_ssize_t j = 0; j < a.njobs; j++) {
            PyObject *c = PySequence_Fast_GET_ITEM(expected, j);
            unsigned long v;
            if (c == Py_None)
                continue;
            v = PyLong_AsUnsignedLong(c);
            if ((v == (unsigned long)-1 && PyErr_Occurred()) ||
                v > 0xFFFFFFFFul) {
                if (!PyErr_Occurred() ||
                    PyErr_ExceptionMatches(PyExc_OverflowError)) {
                    PyErr_Clear();
                    PyErr_Format(PyExc_ValueError,
                                 "crcs[%zd] must be a CRC-32 in [0, 2**32)", j);
                }
                goto out;
            }
            jobs[j].crc = (uint32_t)v;
            jobs[j].has_crc = 1;
        }
    }
    Py_BEGIN_ALLOW_THREADS
        rc = ss_io_read(os, pool, a.paths, (size_t)a.npaths, jobs,
                        (size_t)a.njobs, &o, crcs, &info);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        ss_py_raise(st, rc, &info);
    else
        result = crc_list(crcs, a.njobs);
out:
    Py_XDECREF(expected);
    PyMem_Free(jobs);
    PyMem_Free(crcs);
    PyMem_Free(dev);
    args_release(&a);
    return result;
}

/* ---- read_records ------------------------------------------------------- */

/* Columns of read_records' table (python/shardstate/io.py REC_COLUMNS). */
enum {
    RC_FILE,
    RC_KIND,
    RC_OFFSET,
    RC_LEN,
    RC_CRC,
    RC_WHOLE,
    RC_ADDR,
    RC_DST_LEN,
    RC_START,
    RC_COUNT,
    RC_NDIM,
    RC_ELSIZE,
    RC_SRC_OFF,
    RC_GEOM,
    RC_NCOLS
};

/* A C-contiguous int64 (or uint32 out) buffer of ndim dims. */
static int int_view(PyObject *obj, const char *what, int ndim, int writable,
                    Py_buffer *v)
{
    const char *f;
    int want = writable ? 4 : 8;
    if (PyObject_GetBuffer(obj, v,
                           PyBUF_C_CONTIGUOUS | PyBUF_FORMAT |
                               (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    f = v->format != NULL ? v->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (v->ndim != ndim || v->itemsize != want ||
        (writable ? strcmp(f, "I") != 0
                  : strcmp(f, "q") != 0 && strcmp(f, "l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous %d-d %s array",
                     what, ndim, writable ? "uint32" : "int64");
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

/* Table row i -> *r (pointers into geom); ValueError naming the entry. */
static int rec_of(const int64_t *row, Py_ssize_t i, const int64_t *geom,
                  Py_ssize_t ngeom, ss_io_rec *r)
{
    const char *what = NULL;
    int64_t nd = row[RC_NDIM], g = row[RC_GEOM];

    if (row[RC_FILE] < 0 || row[RC_FILE] > UINT32_MAX)
        what = "file index out of range";
    else if (row[RC_KIND] != SS_IO_REC_RANGE &&
             row[RC_KIND] != SS_IO_REC_SCATTER)
        what = "kind must be 0 (range) or 1 (scatter)";
    else if (row[RC_LEN] < 0 || row[RC_DST_LEN] < 0 || row[RC_START] < 0 ||
             row[RC_COUNT] < 0 || row[RC_ELSIZE] < 0)
        what = "a length, start or count is negative";
    else if (row[RC_CRC] < 0 || row[RC_CRC] > UINT32_MAX)
        what = "crc must be in [0, 2**32)";
    else if (row[RC_KIND] == SS_IO_REC_SCATTER &&
             (nd < 0 || nd > SS_IO_REC_MAX_NDIM || g < 0 || g > ngeom ||
              3 * nd > ngeom - g))
        what = "ndim outside 0..64 or its geometry outside the geom array";
    if (what != NULL) {
        PyErr_Format(PyExc_ValueError, "read_records: table row %zd: %s", i,
                     what);
        return -1;
    }
    *r = (ss_io_rec){(uint32_t)row[RC_FILE],
                     (int)row[RC_KIND],
                     row[RC_OFFSET],
                     (uint64_t)row[RC_LEN],
                     (uint32_t)row[RC_CRC],
                     row[RC_WHOLE] != 0,
                     0,
                     (void *)(uintptr_t)row[RC_ADDR],
                     (uint64_t)row[RC_DST_LEN],
                     (uint64_t)row[RC_START],
                     (uint64_t)row[RC_COUNT],
                     0,
                     (uint64_t)row[RC_ELSIZE],
                     row[RC_SRC_OFF],
                     NULL,
                     NULL,
                     NULL};
    if (r->kind == SS_IO_REC_SCATTER) {
        r->ndim = (int)nd;
        r->sizes = geom + g;
        r->src_strides = geom + g + nd;
        r->dst_strides = geom + g + 2 * nd;
    }
    return 0;
}

static PyObject *py_read_records(PyObject *m, PyObject *const *args,
                                 Py_ssize_t nargs)
{
    ss_state *st = ss_get_state(m);
    batch_args a = {0};
    ss_io_opts o = SS_IO_OPTS_INIT;
    Py_buffer tv = {0}, gv = {0}, cv = {0};
    ss_io_rec *recs = NULL;
    const ss_os *os = NULL;
    ss_pool *pool = NULL;
    unsigned long long scratch;
    Py_ssize_t n = 0;
    ss_errinfo info;
    int rc;

    if (check_nargs("read_records", nargs, 9) < 0 ||
        get_paths(args[0], &a) < 0 ||
        int_view(args[1], "table", 2, 0, &tv) < 0 ||
        int_view(args[2], "geom", 1, 0, &gv) < 0 ||
        int_view(args[3], "crcs", 1, 1, &cv) < 0 ||
        ss_py_pool_arg(st, args[4], &pool) < 0 ||
        (o.verify = PyObject_IsTrue(args[5])) < 0 ||
        (o.checksum = PyObject_IsTrue(args[6])) < 0 ||
        ss_py_faults_arg(st, args[7], &os) < 0)
        goto out;
    scratch = PyLong_AsUnsignedLongLong(args[8]);
    if (scratch == (unsigned long long)-1 && PyErr_Occurred())
        goto out;
    n = tv.shape[0];
    if (tv.shape[1] != RC_NCOLS || cv.shape[0] != n) {
        PyErr_Format(PyExc_ValueError,
                     "read_records: table must be n x %d and crcs n long "
                     "(got %zd x %zd and %zd)",
                     RC_NCOLS, tv.shape[0], tv.shape[1], cv.shape[0]);
        goto out;
    }
    recs = PyMem_Malloc(((size_t)n + 1) * sizeof *recs);
    if (recs == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (rec_of((const int64_t *)tv.buf + i * RC_NCOLS, i,
                   (const int64_t *)gv.buf, gv.shape[0], &recs[i]) < 0)
            goto out;
    Py_BEGIN_ALLOW_THREADS
        rc = ss_io_read_recs(os, pool, a.paths, (size_t)a.npaths, recs,
                             (size_t)n, &o, (uint64_t)scratch,
                             (uint32_t *)cv.buf, &info);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        ss_py_raise(st, rc, &info);
out:
    PyMem_Free(recs);
    if (tv.obj != NULL)
        PyBuffer_Release(&tv);
    if (gv.obj != NULL)
        PyBuffer_Release(&gv);
    if (cv.obj != NULL)
        PyBuffer_Release(&cv);
    args_release(&a);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* write_records: the table's columns. */
enum { T_FILE, T_OFFSET, T_BUFFER, T_PLAN, T_DEVICE, T_COLS };

/* The job table: a C-contiguous 2-D int64 array of T_COLS columns; its
 * rows are copied to *rows (n of them). */
static int get_table(PyObject *obj, int64_t **rows, Py_ssize_t *n)
{
    Py_buffer v;
    int rc = -1;

    if (int_view(obj, "table", 2, 0, &v) < 0)
        return -1;
    if (v.shape[1] != T_COLS) {
        PyErr_Format(PyExc_ValueError,
                     "table must have shape (n, %d): file, offset, buffer, "
                     "plan, device",
                     T_COLS);
        goto out;
    }
    *n = v.shape[0];
    *rows = PyMem_Malloc((size_t)v.len + 8);
    if (*rows == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    if (v.len > 0)
        memcpy(*rows, v.buf, (size_t)v.len);
    rc = 0;
out:
    PyBuffer_Release(&v);
    return rc;
}

static PyObject *py_write_records(PyObject *m, PyObject *const *args,
                                  Py_ssize_t nargs)
{
    ss_state *st = ss_get_state(m);
    batch_args a = {0};
    ss_io_opts o = SS_IO_OPTS_INIT;
    ss_io_record *recs = NULL;
    const struct ss_zip_plan **plans = NULL;
    PyObject *plan_seq = NULL, *result = NULL;
    int64_t *rows = NULL;
    uint32_t *crcs = NULL;
    char *dev = NULL;
    const ss_os *os = NULL;
    ss_pool *pool = NULL;
    Py_ssize_t n = 0, nbufs, nplans = 0;
    size_t pack_run = 0;
    ss_errinfo info;
    int rc, cuda = 0;

    if (check_nargs("write_records", nargs, 13) < 0 ||
        get_table(args[1], &rows, &n) < 0 ||
        ss_py_stage_arg(st, args[8], &o.stage, &cuda) < 0 ||
        ss_py_stream_arg(args[9], &o.stream) < 0 ||
        ss_py_pool_arg(st, args[4], &pool) < 0 ||
        (o.fsync = PyObject_IsTrue(args[5])) < 0 ||
        (o.checksum = PyObject_IsTrue(args[6])) < 0 ||
        (o.writeback = PyObject_IsTrue(args[7])) < 0 ||
        ss_py_faults_arg(st, args[10], &os) < 0 ||
        piece_arg(args[11], &o.piece) < 0 ||
        piece_arg(args[12], &pack_run) < 0 || get_paths(args[0], &a) < 0)
        goto out;
    nbufs = PySequence_Size(args[2]);
    plan_seq = PySequence_Fast(args[3], "plans must be a sequence");
    if (nbufs < 0 || plan_seq == NULL)
        goto out;
    nplans = PySequence_Fast_GET_SIZE(plan_seq);
    plans = PyMem_Calloc((size_t)nplans + 1, sizeof *plans);
    dev = PyMem_Calloc((size_t)nbufs + 1, 1);
    recs = PyMem_Calloc((size_t)n + 1, sizeof *recs);
    crcs = PyMem_Calloc((size_t)n + 1, sizeof *crcs);
    if (plans == NULL || dev == NULL || recs == NULL || crcs == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < nplans; i++)
        if (ss_py_zip_plan_arg(st, PySequence_Fast_GET_ITEM(plan_seq, i),
                               &plans[i]) < 0)
            goto out;
    for (Py_ssize_t k = 0; k < n; k++) { /* indices first: no view yet */
        const int64_t *r = &rows[k * T_COLS];
        const char *bad = NULL;
        if (r[T_FILE] < 0 || r[T_FILE] >= a.npaths)
            bad = "file is not an index into paths";
        else if (r[T_OFFSET] < 0)
            bad = "offset is negative";
        else if (r[T_BUFFER] < 0 || r[T_BUFFER] >= nbufs)
            bad = "buffer is not an index into buffers";
        else if (r[T_PLAN] < -1 || r[T_PLAN] >= nplans)
            bad = "plan is neither -1 nor an index into plans";
        else if (r[T_DEVICE] != 0 && r[T_DEVICE] != 1)
            bad = "device is neither 0 nor 1";
        else if (r[T_DEVICE] && o.stage == NULL)
            bad = "device is set but no stage was given";
        if (bad != NULL) {
            PyErr_Format(PyExc_ValueError,
                         "table row %zd (file %lld, offset %lld, buffer %lld, "
                         "plan %lld, device %lld): %s",
                         k, (long long)r[0], (long long)r[1], (long long)r[2],
                         (long long)r[3], (long long)r[4], bad);
            goto out;
        }
        dev[r[T_BUFFER]] |= (char)r[T_DEVICE];
    }
    if (get_views(args[2], 0, cuda ? dev : NULL, &a) < 0)
        goto out;
    for (Py_ssize_t k = 0; k < n; k++) {
        const int64_t *r = &rows[k * T_COLS];
        const Py_buffer *v = &a.views[r[T_BUFFER]];
        const struct ss_zip_plan *p = r[T_PLAN] >= 0 ? plans[r[T_PLAN]] : NULL;
        if (p != NULL && (uint64_t)v->len != ss_zip_plan_data_length(p)) {
            PyErr_Format(PyExc_ValueError,
                         "table row %zd: buffers[%lld] has %zd bytes but "
                         "plans[%lld] stores %llu",
                         k, (long long)r[T_BUFFER], v->len,
                         (long long)r[T_PLAN],
                         (unsigned long long)ss_zip_plan_data_length(p));
            goto out;
        }
        recs[k] = (ss_io_record){v->buf,
                                 (uint64_t)v->len,
                                 (uint32_t)r[T_FILE],
                                 r[T_OFFSET],
                                 p,
                                 (int)r[T_DEVICE] && v->len > 0};
    }
    Py_BEGIN_ALLOW_THREADS
        rc = ss_io_write_records(os, pool, a.paths, (size_t)a.npaths, recs,
                                 (size_t)n, &o, pack_run, crcs, &info);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        ss_py_raise(st, rc, &info);
    else
        result = crc_list(crcs, n);
out:
    Py_XDECREF(plan_seq);
    PyMem_Free(plans);
    PyMem_Free(dev);
    PyMem_Free(recs);
    PyMem_Free(crcs);
    PyMem_Free(rows);
    args_release(&a);
    return result;
}

/* _raw_pwrite / _raw_pread: the benchmark baselines. */
static PyObject *raw_common(PyObject *m, PyObject *const *args,
                            Py_ssize_t nargs, int writing)
{
    ss_state *st = ss_get_state(m);
    const char *name = writing ? "_raw_pwrite" : "_raw_pread";
    PyObject *path = NULL;
    Py_buffer v = {0};
    size_t piece = 0;
    ss_errinfo info;
    int rc;

    if (check_nargs(name, nargs, 3) < 0 ||
        !PyUnicode_FSConverter(args[0], &path))
        return NULL;
    if (PyObject_GetBuffer(args[1], &v,
                           writing ? PyBUF_C_CONTIGUOUS
                                   : PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0 ||
        piece_arg(args[2], &piece) < 0)
        goto out;
    Py_BEGIN_ALLOW_THREADS
        if (writing)
            rc = ss_io_raw_pwrite(PyBytes_AS_STRING(path), v.buf, (size_t)v.len,
                                  piece);
        else
            rc = ss_io_raw_pread(PyBytes_AS_STRING(path), v.buf, (size_t)v.len,
                                 piece);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        ss_errinfo_clear(&info);
        ss_errinfo_set(&info, rc, writing ? "pwrite" : "pread",
                       PyBytes_AS_STRING(path), -1, NULL);
        ss_py_raise(st, rc, &info);
    }
out:
    if (v.obj != NULL)
        PyBuffer_Release(&v);
    Py_DECREF(path);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_raw_pwrite(PyObject *m, PyObject *const *args,
                               Py_ssize_t nargs)
{
    return raw_common(m, args, nargs, 1);
}

static PyObject *py_raw_pread(PyObject *m, PyObject *const *args,
                              Py_ssize_t nargs)
{
    return raw_common(m, args, nargs, 0);
}

static PyMethodDef io_methods[] = {
    {"write_batch", (PyCFunction)(void (*)(void))py_write_batch, METH_FASTCALL,
     "write_batch(paths, file_idx, offsets, buffers, pool, fsync, checksum, "
     "piece, faults, writeback, stage, device, stream, patch)\n--\n\n"
     "Write buffers[j] at offsets[j] of paths[file_idx[j]] (files are "
     "created or truncated; with patch, existing files are written in "
     "place and keep their size), with the GIL released. Every path is "
     "opened (and fsynced, with fsync), with or without jobs. Returns the "
     "CRC-32 of "
     "each job (0s when checksum is false). piece 0 = default. writeback: "
     "start each written piece's writeback at once. device: None or a bool "
     "per job; a device job's buffer is staged through stage (a CUDA stage "
     "takes objects with __cuda_array_interface__, copied after the work "
     "queued on stream, an int handle or None)."},
    {"read_batch", (PyCFunction)(void (*)(void))py_read_batch, METH_FASTCALL,
     "read_batch(paths, file_idx, offsets, buffers, crcs, pool, verify, "
     "checksum, piece, faults, stage, device)\n--\n\n"
     "Read len(buffers[j]) bytes at offsets[j] of paths[file_idx[j]] into "
     "the writable buffers[j], with the GIL released. crcs is None or one "
     "int-or-None per job, checked when verify is true. Returns each job's "
     "CRC-32 (0 for jobs neither checksummed nor verified). device: None or "
     "a bool per job; a device job's buffer is staged through stage."},
    {"write_records", (PyCFunction)(void (*)(void))py_write_records,
     METH_FASTCALL,
     "write_records(paths, table, buffers, plans, pool, fsync, checksum, "
     "writeback, stage, stream, faults, piece, pack_run)\n--\n\n"
     "A rank's save in one call, with the GIL released (ss_recwrite.h): each "
     "row of table (int64, shape (n, 5): file index into paths, offset, "
     "buffer index into buffers, plan index into plans or -1, device 0/1) "
     "is a tensor record (buffers[b] framed by plans[p], a RecordPlan: "
     "header, data, trailer with the data's CRC-32, small ones packed) or, "
     "with plan -1, a plain job. Every path is created or truncated (a path "
     "with no row is left empty) and, with fsync, fsynced. Returns each "
     "row's data CRC-32 (a plain row's only with checksum). A device row's "
     "buffer is staged through stage, as in write_batch. piece, pack_run: "
     "bytes per task and per packed run, 0 = default."},
    {"read_records", (PyCFunction)(void (*)(void))py_read_records,
     METH_FASTCALL,
     "read_records(paths, table, geom, crcs, pool, verify, checksum, faults, "
     "scratch)\n--\n\n"
     "A load's record reads as one engine call (ss_io_read_recs), with the "
     "GIL released: table is an n x 14 int64 array (columns: file, kind, "
     "offset, len, crc, whole, addr, dst_len, start, count, ndim, elsize, "
     "src_off, geom), geom an int64 array of each scatter row's sizes, src "
     "and dst byte strides; crcs (uint32, n) receives each row's CRC-32. The "
     "addresses must stay valid for the call (the caller holds the "
     "objects). scratch: bytes of scatter scratch a round may hold."},
    {"_raw_pwrite", (PyCFunction)(void (*)(void))py_raw_pwrite, METH_FASTCALL,
     "_raw_pwrite(path, buffer, piece)\n--\n\n"
     "Benchmark baseline: one thread, plain pwrite loop, no checksum."},
    {"_raw_pread", (PyCFunction)(void (*)(void))py_raw_pread, METH_FASTCALL,
     "_raw_pread(path, buffer, piece)\n--\n\n"
     "Benchmark baseline: one thread, plain pread loop, no checksum."},
    {NULL, NULL, 0, NULL},
};

int ss_py_io_init(PyObject *m, ss_state *st)
{
    (void)st;
    return PyModule_AddFunctions(m, io_methods);
}
