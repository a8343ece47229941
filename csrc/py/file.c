/* file.c - single-file operations (ss_file) and the MappedFile type.
 *
 * publish, read_file, file_size, map_file, unlink, fsync_dir and mkdirs
 * each take an optional FaultInjector last, convert the path, release the
 * GIL around the core call and raise through ss_py_raise.
 *
 * MappedFile owns one read-only mapping made by ss_file_map and exposes it
 * through the buffer protocol; close() unmaps it unless a view is still
 * exported (BufferError, as mmap.mmap does); dealloc unmaps it anyway
 * (no view can outlive the object: each holds a reference).
 */
#include "module.h"
#include "ss_file.h"
#include "ss_os.h"

/* ---- MappedFile --------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    void *addr; /* NULL for an empty or closed file */
    int64_t size;
    Py_ssize_t exports;
    int closed;
} MappedFileObject;

static void unmap(MappedFileObject *self)
{
    ss_file_unmap(NULL, self->addr, self->size);
    self->addr = NULL;
    self->size = 0;
    self->closed = 1;
}

static void MappedFile_dealloc(MappedFileObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    unmap(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int MappedFile_getbuffer(MappedFileObject *self, Py_buffer *view,
                                int flags)
{
    static char empty[1];
    if (self->closed) {
        PyErr_SetString(PyExc_ValueError, "MappedFile is closed");
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)self,
                          self->addr != NULL ? self->addr : empty,
                          (Py_ssize_t)self->size, 1, flags) < 0)
        return -1;
    self->exports++;
    return 0;
}

static void MappedFile_releasebuffer(MappedFileObject *self, Py_buffer *view)
{
    (void)view;
    self->exports--;
}

static PyObject *MappedFile_close(MappedFileObject *self, PyObject *u)
{
    (void)u;
    if (self->exports > 0) {
        PyErr_SetString(PyExc_BufferError,
                        "cannot close a MappedFile while views of it exist");
        return NULL;
    }
    unmap(self);
    Py_RETURN_NONE;
}

static PyObject *MappedFile_enter(PyObject *self, PyObject *u)
{
    (void)u;
    return Py_NewRef(self);
}

static PyObject *MappedFile_exit(MappedFileObject *self, PyObject *args)
{
    (void)args;
    return MappedFile_close(self, NULL);
}

static Py_ssize_t MappedFile_len(MappedFileObject *self)
{
    return (Py_ssize_t)self->size;
}

static PyObject *MappedFile_get_closed(MappedFileObject *self, void *c)
{
    (void)c;
    return PyBool_FromLong(self->closed);
}

static PyMethodDef MappedFile_methods[] = {
    {"close", (PyCFunction)MappedFile_close, METH_NOARGS,
     "close()\n--\n\nUnmap the file (BufferError while views exist)."},
    {"__enter__", (PyCFunction)MappedFile_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)MappedFile_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef MappedFile_getset[] = {
    {"closed", (getter)MappedFile_get_closed, NULL, "Whether it is unmapped.",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot MappedFile_slots[] = {
    {Py_tp_dealloc, MappedFile_dealloc},
    {Py_tp_methods, MappedFile_methods},
    {Py_tp_getset, MappedFile_getset},
    {Py_bf_getbuffer, MappedFile_getbuffer},
    {Py_bf_releasebuffer, MappedFile_releasebuffer},
    {Py_sq_length, MappedFile_len},
    {Py_mp_length, MappedFile_len},
    {Py_tp_doc, "A regular file mapped read-only (map_file()); a buffer."},
    {0, NULL},
};

static PyType_Spec MappedFile_spec = {
    .name = "shardstate._core.MappedFile",
    .basicsize = sizeof(MappedFileObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = MappedFile_slots,
};

/* ---- entry points ------------------------------------------------------- */

/* The common head of every entry point: nargs check, the path as bytes in
 * *path (new reference) and the faults argument (the last one). */
static int path_and_faults(ss_state *st, const char *name,
                           PyObject *const *args, Py_ssize_t nargs,
                           Py_ssize_t want, PyObject **path, const ss_os **os)
{
    *path = NULL;
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)",
                     name, want, nargs);
        return -1;
    }
    if (!PyUnicode_FSConverter(args[0], path))
        return -1;
    if (ss_py_faults_arg(st, args[want - 1], os) < 0) {
        Py_CLEAR(*path);
        return -1;
    }
    return 0;
}

static PyObject *py_publish(PyObject *m, PyObject *const *args,
                            Py_ssize_t nargs)
{
    ss_state *st = ss_get_state(m);
    PyObject *path;
    Py_buffer v = {0};
    const ss_os *os;
    ss_errinfo info;
    int rc, durable = 0;

    if (path_and_faults(st, "publish", args, nargs, 4, &path, &os) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &v, PyBUF_C_CONTIGUOUS) < 0 ||
        (durable = PyObject_IsTrue(args[2])) < 0)
        goto out;
    Py_BEGIN_ALLOW_THREADS
        rc = ss_file_publish(os, PyBytes_AS_STRING(path), v.buf, (size_t)v.len,
                             durable, &info);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        ss_py_raise(st, rc, &info);
out:
    if (v.obj != NULL)
        PyBuffer_Release(&v);
    Py_DECREF(path);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_read_file(PyObject *m, PyObject *const *args,
                              Py_ssize_t nargs)
{
    ss_state *st = ss_get_state(m);
    PyObject *path, *result = NULL;
    const ss_os *os;
    unsigned long long max;
    void *buf = NULL;
    uint64_t len = 0;
    ss_errinfo info;
    int rc;

    if (path_and_faults(st, "read_file", args, nargs, 3, &path, &os) < 0)
        return NULL;
    max = PyLong_AsUnsignedLongLong(args[1]);
    if (max == (unsigned long long)-1 && PyErr_Occurred())
        goto out;
    Py_BEGIN_ALLOW_THREADS
        rc = ss_file_read(os, PyBytes_AS_STRING(path), max, &buf, &len, &info);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        ss_py_raise(st, rc, &info);
    else if (len > (uint64_t)PY_SSIZE_T_MAX)
        PyErr_NoMemory();
    else
        result = PyBytes_FromStringAndSize(buf, (Py_ssize_t)len);
    free(buf);
out:
    Py_DECREF(path);
    return result;
}

static PyObject *py_file_size(PyObject *m, PyObject *const *args,
                              Py_ssize_t nargs)
{
    ss_state *st = ss_get_state(m);
    PyObject *path;
    const ss_os *os;
    int64_t size = 0;
    ss_errinfo info;
    int rc;

    if (path_and_faults(st, "file_size", args, nargs, 2, &path, &os) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
        rc = ss_file_size(os, PyBytes_AS_STRING(path), &size, &info);
    Py_END_ALLOW_THREADS
    Py_DECREF(path);
    if (rc < 0)
        return ss_py_raise(st, rc, &info);
    return PyLong_FromLongLong(size);
}

static PyObject *py_map_file(PyObject *m, PyObject *const *args,
                             Py_ssize_t nargs)
{
    ss_state *st = ss_get_state(m);
    PyObject *path;
    MappedFileObject *self;
    const ss_os *os;
    void *addr = NULL;
    int64_t size = 0;
    ss_errinfo info;
    int rc;

    if (path_and_faults(st, "map_file", args, nargs, 2, &path, &os) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
        rc = ss_file_map(os, PyBytes_AS_STRING(path), &addr, &size, &info);
    Py_END_ALLOW_THREADS
    Py_DECREF(path);
    if (rc < 0)
        return ss_py_raise(st, rc, &info);
    self = PyObject_New(MappedFileObject, st->MappedFile_type);
    if (self == NULL) {
        ss_file_unmap(NULL, addr, size);
        return NULL;
    }
    self->addr = addr;
    self->size = size;
    self->exports = 0;
    self->closed = 0;
    return (PyObject *)self;
}

static PyObject *py_unlink(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    ss_state *st = ss_get_state(m);
    PyObject *path;
    const ss_os *os;
    ss_errinfo info;
    int rc, missing_ok;

    if (path_and_faults(st, "unlink", args, nargs, 3, &path, &os) < 0)
        return NULL;
    if ((missing_ok = PyObject_IsTrue(args[1])) < 0) {
        Py_DECREF(path);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
        rc = ss_file_unlink(os, PyBytes_AS_STRING(path), missing_ok, &info);
    Py_END_ALLOW_THREADS
    Py_DECREF(path);
    if (rc < 0)
        return ss_py_raise(st, rc, &info);
    return PyBool_FromLong(rc);
}

/* fsync_dir(path, faults) and mkdirs(path, faults): a path, nothing back. */
static PyObject *dir_op(PyObject *m, PyObject *const *args, Py_ssize_t nargs,
                        const char *name,
                        int (*fn)(const ss_os *, const char *, ss_errinfo *))
{
    ss_state *st = ss_get_state(m);
    PyObject *path;
    const ss_os *os;
    ss_errinfo info;
    int rc;

    if (path_and_faults(st, name, args, nargs, 2, &path, &os) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
        rc = fn(os, PyBytes_AS_STRING(path), &info);
    Py_END_ALLOW_THREADS
    Py_DECREF(path);
    if (rc < 0)
        return ss_py_raise(st, rc, &info);
    Py_RETURN_NONE;
}

static PyObject *py_fsync_dir(PyObject *m, PyObject *const *args,
                              Py_ssize_t nargs)
{
    return dir_op(m, args, nargs, "fsync_dir", ss_file_fsync_dir);
}

static PyObject *py_mkdirs(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    return dir_op(m, args, nargs, "mkdirs", ss_file_mkdirs);
}

#define SS__FAST(fn) (PyCFunction)(void (*)(void))(fn), METH_FASTCALL

static PyMethodDef file_methods[] = {
    {"publish", SS__FAST(py_publish),
     "publish(path, data, fsync, faults)\n--\n\n"
     "Atomically replace path with data (temp file, fsync, rename, fsync "
     "of the directory)."},
    {"read_file", SS__FAST(py_read_file),
     "read_file(path, max_bytes, faults)\n--\n\n"
     "The whole regular file (1..max_bytes bytes) as bytes."},
    {"file_size", SS__FAST(py_file_size),
     "file_size(path, faults)\n--\n\nThe size of a regular file."},
    {"map_file", SS__FAST(py_map_file),
     "map_file(path, faults)\n--\n\n"
     "A regular file mapped read-only, as a MappedFile (a buffer)."},
    {"unlink", SS__FAST(py_unlink),
     "unlink(path, missing_ok, faults)\n--\n\n"
     "Remove a file; True if removed, False if missing and missing_ok."},
    {"fsync_dir", SS__FAST(py_fsync_dir),
     "fsync_dir(path, faults)\n--\n\nfsync a directory."},
    {"mkdirs", SS__FAST(py_mkdirs),
     "mkdirs(path, faults)\n--\n\n"
     "Create a directory and its missing parents (existing ones are fine)."},
    {NULL, NULL, 0, NULL},
};

#undef SS__FAST

int ss_py_file_init(PyObject *m, ss_state *st)
{
    st->MappedFile_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(m, &MappedFile_spec, NULL);
    if (st->MappedFile_type == NULL ||
        PyModule_AddType(m, st->MappedFile_type) < 0)
        return -1;
    return PyModule_AddFunctions(m, file_methods);
}
