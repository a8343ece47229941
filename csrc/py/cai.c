/* cai.c - device buffers and streams from Python objects: the CUDA Array
 * Interface (__cuda_array_interface__, as torch's CUDA tensors, CuPy and
 * Numba arrays give it; only the pointer and the length are taken, the
 * caller keeps the object alive while the memory is used), and stream
 * handles given as ints. */
#include "module.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Bytes per item of a __cuda_array_interface__ typestr ("<f4", "|b1"). */
static Py_ssize_t typestr_itemsize(PyObject *t)
{
    const char *s = PyUnicode_Check(t) ? PyUnicode_AsUTF8(t) : NULL;
    char *end = NULL;
    long n;
    if (s == NULL || strlen(s) < 3 || strchr("<>|=", s[0]) == NULL)
        return -1;
    n = strtol(s + 2, &end, 10);
    return end != NULL && *end == '\0' && n > 0 && n <= 64 ? n : -1;
}

int ss_py_cai_buffer(PyObject *item, const char *what, int writable, void **out,
                     Py_ssize_t *out_len)
{
    PyObject *cai = PyObject_GetAttrString(item, "__cuda_array_interface__");
    PyObject *shape, *typestr, *data, *strides, *mask;
    Py_ssize_t itemsize, n, nbytes = 1;
    unsigned long long ptr;
    int rc = -1, readonly;

    if (cai == NULL || !PyDict_Check(cai)) {
        if (cai != NULL || PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "%s is a CUDA buffer but %.200s has no "
                         "__cuda_array_interface__ dict",
                         what, Py_TYPE(item)->tp_name);
        }
        goto out;
    }
    shape = PyDict_GetItemString(cai, "shape");
    typestr = PyDict_GetItemString(cai, "typestr");
    data = PyDict_GetItemString(cai, "data");
    strides = PyDict_GetItemString(cai, "strides");
    mask = PyDict_GetItemString(cai, "mask");
    if (shape == NULL || !PyTuple_Check(shape) || typestr == NULL ||
        (itemsize = typestr_itemsize(typestr)) < 0 || data == NULL ||
        !PyTuple_Check(data) || PyTuple_GET_SIZE(data) != 2 ||
        (mask != NULL && mask != Py_None)) {
        PyErr_Format(PyExc_ValueError, "%s: malformed __cuda_array_interface__",
                     what);
        goto out;
    }
    n = PyTuple_GET_SIZE(shape);
    for (Py_ssize_t d = 0; d < n; d++) {
        Py_ssize_t k = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, d));
        if (k < 0 || (k > 0 && nbytes > PY_SSIZE_T_MAX / k)) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError,
                             "%s: bad shape in "
                             "__cuda_array_interface__",
                             what);
            goto out;
        }
        nbytes *= k;
    }
    if (nbytes > PY_SSIZE_T_MAX / itemsize) {
        PyErr_Format(PyExc_ValueError, "%s is too large", what);
        goto out;
    }
    nbytes *= itemsize;
    if (strides != NULL && strides != Py_None && nbytes > 0) {
        /* explicit strides must be the C-contiguous ones */
        Py_ssize_t want = itemsize;
        if (!PyTuple_Check(strides) || PyTuple_GET_SIZE(strides) != n)
            goto not_contiguous;
        for (Py_ssize_t d = n - 1; d >= 0; d--) {
            Py_ssize_t k = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, d));
            Py_ssize_t sd = PyLong_AsSsize_t(PyTuple_GET_ITEM(strides, d));
            if (sd == -1 && PyErr_Occurred())
                goto out;
            if (k > 1 && sd != want)
                goto not_contiguous;
            want *= k;
        }
    }
    ptr = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(data, 0));
    if (ptr == (unsigned long long)-1 && PyErr_Occurred())
        goto out;
    readonly = PyObject_IsTrue(PyTuple_GET_ITEM(data, 1));
    if (readonly < 0)
        goto out;
    if (writable && readonly) {
        PyErr_Format(PyExc_BufferError,
                     "%s must be writable to read into it (its "
                     "__cuda_array_interface__ is read-only)",
                     what);
        goto out;
    }
    if (ptr == 0 && nbytes > 0) {
        PyErr_Format(PyExc_ValueError, "%s has a NULL device pointer", what);
        goto out;
    }
    *out = (void *)(uintptr_t)ptr;
    *out_len = nbytes;
    rc = 0;
    goto out;
not_contiguous:
    PyErr_Format(PyExc_BufferError,
                 "%s must be C-contiguous (its "
                 "__cuda_array_interface__ has other strides)",
                 what);
out:
    Py_XDECREF(cai);
    return rc;
}

int ss_py_stream_arg(PyObject *obj, void **out)
{
    unsigned long long v;
    *out = NULL;
    if (obj == Py_None)
        return 0;
    v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (void *)(uintptr_t)v;
    return 0;
}
