/* errors.c - the exception types and the one function that turns a core
 * error code into a Python exception. */
#include "module.h"

#include <string.h>

/* error_codes(): {"SS_EINVAL": -1001, ...}, the core's own codes, so Python
 * tells them apart by name (an exception's `code` attribute). */
static PyObject *py_error_codes(PyObject *m, PyObject *u)
{
    PyObject *d = PyDict_New(), *v;
    (void)m;
    (void)u;
    if (d == NULL)
        return NULL;
#define SS__ITEM(name, value, msg)                                             \
    v = PyLong_FromLong(value);                                                \
    if (v == NULL || PyDict_SetItemString(d, #name, v) < 0) {                  \
        Py_XDECREF(v);                                                         \
        Py_DECREF(d);                                                          \
        return NULL;                                                           \
    }                                                                          \
    Py_DECREF(v);
    SS_ERROR_TABLE(SS__ITEM)
#undef SS__ITEM
    return d;
}

static PyMethodDef errors_methods[] = {
    {"error_codes", py_error_codes, METH_NOARGS,
     "error_codes()\n--\n\nThe core's own error codes by name (the `code` "
     "attribute of its exceptions; -errno codes are OSErrors)."},
    {NULL, NULL, 0, NULL},
};

int ss_py_errors_init(PyObject *m, ss_state *st)
{
    PyObject *bases = NULL;
    int rc = -1;

    st->Error = PyErr_NewExceptionWithDoc(
        "shardstate.ShardstateError",
        "Base class of the errors raised by shardstate's core.", NULL, NULL);
    if (st->Error == NULL)
        goto out;
    bases = PyTuple_Pack(2, st->Error, PyExc_OSError);
    if (bases == NULL)
        goto out;
    st->IOError = PyErr_NewExceptionWithDoc(
        "shardstate.ShardstateIOError",
        "An operating-system I/O failure (errno, strerror and filename set).",
        bases, NULL);
    if (st->IOError == NULL)
        goto out;
    st->ChecksumError = PyErr_NewExceptionWithDoc(
        "shardstate.ChecksumError",
        "Data read back does not match its recorded checksum.", st->Error,
        NULL);
    if (st->ChecksumError == NULL)
        goto out;
    if (PyModule_AddObjectRef(m, "ShardstateError", st->Error) < 0 ||
        PyModule_AddObjectRef(m, "ShardstateIOError", st->IOError) < 0 ||
        PyModule_AddObjectRef(m, "ChecksumError", st->ChecksumError) < 0 ||
        PyModule_AddFunctions(m, errors_methods) < 0)
        goto out;
    rc = 0;
out:
    Py_XDECREF(bases);
    return rc;
}

/* " [op 'path' at offset N, job J: detail]" describing where it happened. */
static PyObject *where_text(const ss_errinfo *info)
{
    char buf[SS_ERR_PATH_MAX + SS_ERR_DETAIL_MAX + 128];
    size_t n = 0;

    buf[0] = '\0';
#define SS__ADD(...)                                                           \
    do {                                                                       \
        if (n < sizeof buf) {                                                  \
            int k_ = snprintf(buf + n, sizeof buf - n, __VA_ARGS__);           \
            if (k_ > 0)                                                        \
                n += (size_t)k_;                                               \
        }                                                                      \
    } while (0)
    if (info != NULL) {
        if (info->op != NULL)
            SS__ADD("%s", info->op);
        if (info->path[0] != '\0')
            SS__ADD("%s'%s'", n ? " " : "", info->path);
        if (info->offset >= 0)
            SS__ADD("%sat offset %lld", n ? " " : "", (long long)info->offset);
        if (info->job >= 0)
            SS__ADD("%sjob %lld", n ? ", " : "", (long long)info->job);
        if (info->detail[0] != '\0')
            SS__ADD("%s%s", n ? ": " : "", info->detail);
    }
#undef SS__ADD
    if (n >= sizeof buf)
        n = sizeof buf - 1;
    return PyUnicode_DecodeUTF8(buf, (Py_ssize_t)n, "replace");
}

/* Attach op/path/offset/job to the exception being raised. Best effort. */
static void annotate(PyObject *exc, const ss_errinfo *info)
{
    PyObject *v;
    v = (info != NULL && info->op != NULL) ? PyUnicode_FromString(info->op)
                                           : Py_NewRef(Py_None);
    if (v != NULL) {
        (void)PyObject_SetAttrString(exc, "op", v);
        Py_DECREF(v);
    }
    v = (info != NULL && info->path[0] != '\0')
            ? PyUnicode_DecodeFSDefault(info->path)
            : Py_NewRef(Py_None);
    if (v != NULL) {
        (void)PyObject_SetAttrString(exc, "path", v);
        Py_DECREF(v);
    }
    v = PyLong_FromLongLong(info != NULL ? info->offset : -1);
    if (v != NULL) {
        (void)PyObject_SetAttrString(exc, "offset", v);
        Py_DECREF(v);
    }
    v = PyLong_FromLongLong(info != NULL ? info->job : -1);
    if (v != NULL) {
        (void)PyObject_SetAttrString(exc, "job", v);
        Py_DECREF(v);
    }
    PyErr_Clear();
}

PyObject *ss_py_raise(ss_state *st, int rc, const ss_errinfo *info)
{
    PyObject *where = NULL, *msg = NULL, *exc = NULL, *type;
    const char *base;

    if (PyErr_Occurred())
        return NULL; /* a Python-level error came first; keep it */
    if (rc == SS_ENOMEM || rc == -ENOMEM)
        return PyErr_NoMemory();
    where = where_text(info);
    if (where == NULL)
        return NULL;

    if (ss_is_errno(rc)) {
        int err = -rc;
        PyObject *path = NULL;
        if (info != NULL && info->path[0] != '\0')
            path = PyUnicode_DecodeFSDefault(info->path);
        else
            path = Py_NewRef(Py_None);
        if (path == NULL)
            goto out;
        msg = PyUnicode_GetLength(where) > 0
                  ? PyUnicode_FromFormat("%s [%U]", strerror(err), where)
                  : PyUnicode_FromString(strerror(err));
        if (msg != NULL)
            exc = PyObject_CallFunction(st->IOError, "iOO", err, msg, path);
        Py_DECREF(path);
    } else {
        base = ss_strerror(rc);
        if (base == NULL)
            base = "unknown error";
        if (rc == SS_ECHECKSUM)
            type = st->ChecksumError;
        else if (rc == SS_EINVAL)
            type = PyExc_ValueError;
        else
            type = st->Error;
        msg = PyUnicode_GetLength(where) > 0
                  ? PyUnicode_FromFormat("%s: %U", base, where)
                  : PyUnicode_FromString(base);
        if (msg != NULL)
            exc = PyObject_CallOneArg(type, msg);
    }
    if (exc == NULL)
        goto out;
    annotate(exc, info);
    {
        PyObject *code = PyLong_FromLong(rc);
        if (code != NULL) {
            (void)PyObject_SetAttrString(exc, "code", code);
            Py_DECREF(code);
        }
        PyErr_Clear();
    }
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
out:
    Py_XDECREF(exc);
    Py_XDECREF(msg);
    Py_XDECREF(where);
    return NULL;
}
