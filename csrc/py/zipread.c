/* zipread.c - parse_tensor_record(): the C recognition of a torch.save
 * tensor record (ss_zipread.h) for shardstate/checkpoint/_records.py, which
 * falls back to the Python parser (_zipfmt.parse_record, the reference)
 * when this one refuses a record. The bytes are read through the buffer
 * protocol; only the zip structures and the small entries are touched. */
#include "module.h"
#include "ss_zipread.h"

static PyObject *py_parse_tensor_record(PyObject *m, PyObject *arg)
{
    ss_state *st = ss_get_state(m);
    ss_zip_tensor *t = NULL;
    PyObject *shape = NULL, *stride = NULL, *crc = NULL, *out = NULL;
    ss_errinfo err;
    Py_buffer view;
    int rc, dense;

    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    t = PyMem_Malloc(sizeof *t);
    if (t == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    ss_errinfo_clear(&err);
    rc = ss_zipread_tensor(view.buf, (size_t)view.len, t, &err);
    if (rc == SS_EINVAL) {
        out = Py_NewRef(Py_None); /* refused: the reference parser decides */
        goto out;
    }
    if (rc < 0) {
        ss_py_raise(st, rc, &err);
        goto out;
    }
    /* dense: the storage is exactly the tensor, row-major from 0 */
    {
        int64_t want = 1;
        dense = !t->conj && !t->neg && t->storage_offset == 0;
        for (int d = t->ndim - 1; d >= 0; d--) {
            dense &= t->stride[d] == want;
            want *= t->shape[d];
        }
        dense &= want == t->storage_numel;
    }
    shape = ss_py_int_tuple(t->shape, (size_t)t->ndim);
    stride = ss_py_int_tuple(t->stride, (size_t)t->ndim);
    /* None: a record torch wrote without CRC-32s has none to check */
    crc = t->has_crc ? PyLong_FromUnsignedLong(t->data_crc32)
                     : Py_NewRef(Py_None);
    if (shape != NULL && stride != NULL && crc != NULL)
        out = Py_BuildValue(
            "(sOOLLOKKOOOO)", t->dtype, shape, stride,
            (long long)t->storage_offset, (long long)t->storage_numel,
            t->requires_grad ? Py_True : Py_False,
            (unsigned long long)t->data_offset,
            (unsigned long long)t->data_length, crc,
            t->conj ? Py_True : Py_False, t->neg ? Py_True : Py_False,
            dense ? Py_True : Py_False);
out:
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    Py_XDECREF(crc);
    PyMem_Free(t);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef zipread_methods[] = {
    {"parse_tensor_record", py_parse_tensor_record, METH_O,
     "parse_tensor_record(record, /)\n--\n\n"
     "The torch.save tensor record held whole in the buffer, recognised in "
     "C: (dtype, shape, stride, storage_offset, storage_numel, "
     "requires_grad, data_offset, data_length, data_crc32 (None when the "
     "record has no CRC-32s), conj, neg, "
     "dense: the storage is exactly the tensor, row-major from 0), "
     "offsets inside the buffer; None when refused (the C parser accepts a "
     "subset of what _zipfmt.parse_record accepts, with the same results)."},
    {NULL, NULL, 0, NULL},
};

int ss_py_zipread_init(PyObject *m, ss_state *st)
{
    (void)st;
    return PyModule_AddFunctions(m, zipread_methods);
}
