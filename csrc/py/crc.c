/* crc.c - crc32(), crc32c() and their combine functions, and the test-only
 * _crc_force_portable().
 * Buffers are read through the buffer protocol; the GIL is released while
 * large ones are checksummed. Thread safety: as ss_crc.h; the
 * force-portable switch is process-wide (tests only). */
#include "module.h"
#include "ss_crc.h"

/* Below this many bytes releasing the GIL costs more than it saves. */
#define SS_CRC_NOGIL_MIN 4096

typedef uint32_t (*crc_fn)(uint32_t, const void *, size_t);

static PyObject *crc_common(PyObject *args, PyObject *kwds, const char *fmt,
                            crc_fn fn)
{
    static char *kwlist[] = {"data", "value", NULL};
    Py_buffer view;
    PyObject *value_obj = NULL;
    unsigned long value = 0;
    uint32_t crc;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, fmt, kwlist, &view,
                                     &value_obj))
        return NULL;
    if (value_obj != NULL) {
        value = PyLong_AsUnsignedLongMask(value_obj);
        if (value == (unsigned long)-1 && PyErr_Occurred()) {
            PyBuffer_Release(&view);
            return NULL;
        }
    }
    crc = (uint32_t)value;
    if (view.len >= SS_CRC_NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
            crc = fn(crc, view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        crc = fn(crc, view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *py_crc32(PyObject *m, PyObject *args, PyObject *kwds)
{
    (void)m;
    return crc_common(args, kwds, "y*|O:crc32", ss_crc32);
}

static PyObject *py_crc32c(PyObject *m, PyObject *args, PyObject *kwds)
{
    (void)m;
    return crc_common(args, kwds, "y*|O:crc32c", ss_crc32c);
}

typedef uint32_t (*combine_fn)(uint32_t, uint32_t, uint64_t);

static PyObject *combine_common(PyObject *const *args, Py_ssize_t nargs,
                                const char *name, combine_fn fn)
{
    unsigned long a, b;
    long long len2;

    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError,
                            "%s() takes 3 arguments (crc1, crc2, len2)", name);
    a = PyLong_AsUnsignedLongMask(args[0]);
    if (a == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    b = PyLong_AsUnsignedLongMask(args[1]);
    if (b == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    len2 = PyLong_AsLongLong(args[2]);
    if (len2 == -1 && PyErr_Occurred())
        return NULL;
    if (len2 < 0)
        return PyErr_Format(PyExc_ValueError, "%s(): len2 must be >= 0", name);
    return PyLong_FromUnsignedLong(
        fn((uint32_t)a, (uint32_t)b, (uint64_t)len2));
}

static PyObject *py_crc32_combine(PyObject *m, PyObject *const *args,
                                  Py_ssize_t nargs)
{
    (void)m;
    return combine_common(args, nargs, "crc32_combine", ss_crc32_combine);
}

static PyObject *py_crc32c_combine(PyObject *m, PyObject *const *args,
                                   Py_ssize_t nargs)
{
    (void)m;
    return combine_common(args, nargs, "crc32c_combine", ss_crc32c_combine);
}

static PyObject *py_crc_impl(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    return Py_BuildValue("{ssss}", "crc32", ss_crc32_impl(), "crc32c",
                         ss_crc32c_impl());
}

/* Test-only: route both checksums through the portable code (or back).
 * Process-wide; returns the previous setting. */
static PyObject *py_crc_force_portable(PyObject *m, PyObject *on)
{
    int flag = PyObject_IsTrue(on);

    (void)m;
    if (flag < 0)
        return NULL;
    return PyBool_FromLong(ss_crc_force_portable(flag));
}

static PyMethodDef crc_methods[] = {
    {"crc32", (PyCFunction)(void (*)(void))py_crc32,
     METH_VARARGS | METH_KEYWORDS,
     "crc32(data, value=0)\n--\n\nCRC-32 (zlib polynomial) of data, "
     "continuing from value; equal to zlib.crc32."},
    {"crc32c", (PyCFunction)(void (*)(void))py_crc32c,
     METH_VARARGS | METH_KEYWORDS,
     "crc32c(data, value=0)\n--\n\nCRC-32C (Castagnoli) of data, "
     "continuing from value."},
    {"crc32_combine", (PyCFunction)(void (*)(void))py_crc32_combine,
     METH_FASTCALL,
     "crc32_combine(crc1, crc2, len2)\n--\n\nCRC-32 of A+B from crc32(A), "
     "crc32(B) and len(B)."},
    {"crc32c_combine", (PyCFunction)(void (*)(void))py_crc32c_combine,
     METH_FASTCALL,
     "crc32c_combine(crc1, crc2, len2)\n--\n\nCRC-32C of A+B from "
     "crc32c(A), crc32c(B) and len(B)."},
    {"crc_implementation", py_crc_impl, METH_NOARGS,
     "crc_implementation()\n--\n\nWhich implementation each checksum uses."},
    {"_crc_force_portable", py_crc_force_portable, METH_O,
     "_crc_force_portable(on)\n--\n\nTest-only: make crc32/crc32c use the "
     "portable code (process-wide). Returns the previous setting."},
    {NULL, NULL, 0, NULL},
};

int ss_py_crc_init(PyObject *m, ss_state *st)
{
    (void)st;
    return PyModule_AddFunctions(m, crc_methods);
}
