/* pickle.c - pickle_scan(): the opcode scan of ss_pickle.h, for the
 * restricted unpickler in shardstate/checkpoint/_pickle/unpickler.py. The
 * data is read through the buffer protocol; the GIL is released for large
 * ones. */
#include "module.h"
#include "ss_pickle.h"

/* Below this many bytes releasing the GIL costs more than it saves. */
#define SS_SCAN_NOGIL_MIN 65536

static PyObject *py_pickle_scan(PyObject *m, PyObject *arg)
{
    ss_state *st = ss_get_state(m);
    ss_errinfo err;
    ss_pickle_info info;
    Py_buffer view;
    int rc;

    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    ss_errinfo_clear(&err);
    if (view.len >= SS_SCAN_NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
            rc = ss_pickle_scan(view.buf, (size_t)view.len, &info, &err);
        Py_END_ALLOW_THREADS
    } else {
        rc = ss_pickle_scan(view.buf, (size_t)view.len, &info, &err);
    }
    PyBuffer_Release(&view);
    if (rc < 0)
        return ss_py_raise(st, rc, &err);
    return Py_BuildValue("(in)", info.proto, (Py_ssize_t)info.end);
}

static PyMethodDef pickle_methods[] = {
    {"pickle_scan", py_pickle_scan, METH_O,
     "pickle_scan(data, /)\n--\n\nChecks a pickle's opcode stream before the "
     "C unpickler may run on it: no persistent ids, copyreg extensions or "
     "out-of-band buffers; every argument inside the data and inside its "
     "FRAME; PROTO only "
     "first; memo indices at most the entries stored; nesting at most "
     "SS_PICKLE_DEPTH_MAX deep and DUP bounded (a model of the stack). Returns "
     "(protocol, offset past STOP); raises ValueError (an opcode refused) "
     "or ShardstateError (out of bounds) naming the offset."},
    {NULL, NULL, 0, NULL},
};

int ss_py_pickle_init(PyObject *m, ss_state *st)
{
    (void)st;
    return PyModule_AddFunctions(m, pickle_methods);
}
