/* safetensors.c - parse_safetensors_header(): the checked header of a
 * safetensors file (csrc/core/ss_stheader.h) for shardstate/checkpoint/
 * _safetensors.py. The header bytes come in through the buffer protocol
 * and are parsed with the GIL released; a malformed header is answered
 * with its reason (a str: the caller names the file), never an exception,
 * so the one place that turns it into SafetensorsError is the caller. */
#include "module.h"
#include "ss_stheader.h"

#include <string.h>

#define MAX_DTYPES 32

/* (metadata dict or None, [(name, dtype, shape, file offset, nbytes)]) */
static PyObject *result(const ss_st_header *h, long long data_start)
{
    PyObject *meta = NULL, *rows = NULL, *out = NULL;
    PyObject *names[MAX_DTYPES] = {NULL}; /* dtype strings, reused */
    int nd = ss_st_ndtypes();

    if (nd > MAX_DTYPES)
        nd = MAX_DTYPES;
    if (h->has_metadata) {
        meta = PyDict_New();
        for (size_t i = 0; meta != NULL && i < h->nmeta; i++) {
            const size_t *m = h->meta + 4 * i;
            PyObject *k =
                PyUnicode_DecodeUTF8(h->strings + m[0], (Py_ssize_t)m[1], NULL);
            PyObject *v = k == NULL
                              ? NULL
                              : PyUnicode_DecodeUTF8(h->strings + m[2],
                                                     (Py_ssize_t)m[3], NULL);
            if (v == NULL || PyDict_SetItem(meta, k, v) < 0)
                Py_CLEAR(meta);
            Py_XDECREF(k);
            Py_XDECREF(v);
        }
    } else {
        meta = Py_NewRef(Py_None);
    }
    if (meta == NULL)
        goto out;
    rows = PyList_New((Py_ssize_t)h->ntensors);
    for (size_t i = 0; rows != NULL && i < h->ntensors; i++) {
        const ss_st_tensor *t = &h->tensors[i];
        PyObject *name, *shape, *row;
        if (t->dtype >= nd) {
            PyErr_SetString(PyExc_SystemError, "dtype index out of range");
            Py_CLEAR(rows);
            break;
        }
        if (names[t->dtype] == NULL)
            names[t->dtype] = PyUnicode_FromString(ss_st_dtype_name(t->dtype));
        name = PyUnicode_DecodeUTF8(h->strings + t->name_off,
                                    (Py_ssize_t)t->name_len, NULL);
        shape = ss_py_int_tuple(h->dims + t->shape_off, (size_t)t->ndim);
        row = (name == NULL || shape == NULL || names[t->dtype] == NULL)
                  ? NULL
                  : Py_BuildValue("(OOOLK)", name, names[t->dtype], shape,
                                  data_start + (long long)t->begin,
                                  (unsigned long long)(t->end - t->begin));
        Py_XDECREF(name);
        Py_XDECREF(shape);
        if (row == NULL) {
            Py_CLEAR(rows);
            break;
        }
        PyList_SET_ITEM(rows, (Py_ssize_t)i, row);
    }
    if (rows != NULL)
        out = PyTuple_Pack(2, meta, rows);
out:
    for (int d = 0; d < nd; d++)
        Py_XDECREF(names[d]);
    Py_XDECREF(meta);
    Py_XDECREF(rows);
    return out;
}

static PyObject *py_parse_header(PyObject *m, PyObject *const *args,
                                 Py_ssize_t nargs)
{
    ss_state *st = ss_get_state(m);
    ss_st_header *h = NULL;
    unsigned long long data_len;
    long long data_start;
    PyObject *out = NULL;
    ss_errinfo err;
    Py_buffer view;
    int rc;

    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError,
                        "parse_safetensors_header(head, data_len, data_start)");
        return NULL;
    }
    data_len = PyLong_AsUnsignedLongLong(args[1]);
    if (data_len == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    data_start = PyLong_AsLongLong(args[2]);
    if (data_start == -1 && PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    ss_errinfo_clear(&err);
    Py_BEGIN_ALLOW_THREADS
        rc = ss_st_parse(view.buf, (size_t)view.len, data_len, &h, &err);
    Py_END_ALLOW_THREADS
    if (rc == SS_EINVAL || rc == SS_ERANGE)
        out = PyUnicode_DecodeUTF8(err.detail, (Py_ssize_t)strlen(err.detail),
                                   "replace");
    else if (rc < 0)
        ss_py_raise(st, rc, &err);
    else
        out = result(h, data_start);
    ss_st_free(h);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef safetensors_methods[] = {
    {"parse_safetensors_header", (PyCFunction)(void (*)(void))py_parse_header,
     METH_FASTCALL,
     "parse_safetensors_header(head, data_len, data_start, /)\n--\n\n"
     "The safetensors header JSON `head` (after the 8-byte length) of a "
     "file whose data area holds data_len bytes from file offset "
     "data_start, parsed and checked in C: (metadata dict or None, "
     "[(name, dtype, shape, file offset, nbytes), ...] in the header's "
     "order); a str saying what is wrong (naming the tensor) when the "
     "header is malformed."},
    {NULL, NULL, 0, NULL},
};

int ss_py_safetensors_init(PyObject *m, ss_state *st)
{
    (void)st;
    return PyModule_AddFunctions(m, safetensors_methods);
}
