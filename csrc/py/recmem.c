/* recmem.c - the MemSink type: caller buffers as the files of a batch.
 *
 * MemSink(targets) holds a writable view of each target (a bytearray, a
 * BytesIO's getbuffer(), a NumPy array, ...) and an ss_memos over them
 * (ss_recmem.h); passed as `faults` to write_records / write_batch /
 * read_batch, the call's paths "mem:<k>" are target k. The views are held
 * (the targets cannot be resized) until close() or deallocation. Not to be
 * closed while a call that uses it runs.
 */
#include "module.h"
#include "ss_recmem.h"

typedef struct {
    PyObject_HEAD
    Py_buffer *views;
    ss_memfile *files;
    Py_ssize_t n;
    ss_memos memos;
} MemSinkObject;

static void release(MemSinkObject *self)
{
    for (Py_ssize_t i = 0; self->views != NULL && i < self->n; i++)
        if (self->views[i].obj != NULL)
            PyBuffer_Release(&self->views[i]);
    PyMem_Free(self->views);
    PyMem_Free(self->files);
    self->views = NULL;
    self->files = NULL;
    self->n = 0;
    ss_memos_init(&self->memos, NULL, 0);
}

static PyObject *MemSink_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *targets, *seq;
    MemSinkObject *self;

    if (!PyArg_ParseTuple(args, "O:MemSink", &targets) ||
        (kwds != NULL && PyDict_GET_SIZE(kwds) > 0)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError,
                            "MemSink() takes no keyword arguments");
        return NULL;
    }
    seq = PySequence_Fast(targets, "targets must be a sequence of buffers");
    if (seq == NULL)
        return NULL;
    self = (MemSinkObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        goto fail;
    self->n = PySequence_Fast_GET_SIZE(seq);
    self->views = PyMem_Calloc((size_t)self->n + 1, sizeof *self->views);
    self->files = PyMem_Calloc((size_t)self->n + 1, sizeof *self->files);
    if (self->views == NULL || self->files == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < self->n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i),
                               &self->views[i],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto fail;
        self->files[i] = (ss_memfile){(uint8_t *)self->views[i].buf,
                                      (uint64_t)self->views[i].len};
    }
    ss_memos_init(&self->memos, self->files, (size_t)self->n);
    Py_DECREF(seq);
    return (PyObject *)self;
fail:
    Py_DECREF(seq);
    Py_XDECREF(self);
    return NULL;
}

static void MemSink_dealloc(MemSinkObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    release(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *MemSink_close(MemSinkObject *self, PyObject *unused)
{
    (void)unused;
    release(self);
    Py_RETURN_NONE;
}

static PyObject *MemSink_len(MemSinkObject *self, void *c)
{
    (void)c;
    return PyLong_FromSsize_t(self->n);
}

static PyMethodDef MemSink_methods[] = {
    {"close", (PyCFunction)MemSink_close, METH_NOARGS,
     "close()\n--\n\nRelease the targets' views (the sink then has no "
     "files)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef MemSink_getset[] = {
    {"count", (getter)MemSink_len, NULL, "The number of targets held.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot MemSink_slots[] = {
    {Py_tp_new, MemSink_new},
    {Py_tp_dealloc, MemSink_dealloc},
    {Py_tp_methods, MemSink_methods},
    {Py_tp_getset, MemSink_getset},
    {Py_tp_doc,
     "MemSink(targets)\n--\n\nWritable buffers as the files of a batch: "
     "passed as `faults`, the call's path \"mem:<k>\" is targets[k] "
     "(csrc/core/ss_recmem.h: fixed sizes, a write past the end fails "
     "with EFBIG)."},
    {0, NULL},
};

static PyType_Spec MemSink_spec = {
    .name = "shardstate._core.MemSink",
    .basicsize = sizeof(MemSinkObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = MemSink_slots,
};

int ss_py_memsink_os(ss_state *st, PyObject *obj, const ss_os **out)
{
    if (!PyObject_TypeCheck(obj, st->MemSink_type))
        return 0;
    *out = ss_memos_os(&((MemSinkObject *)obj)->memos);
    return 1;
}

int ss_py_recmem_init(PyObject *m, ss_state *st)
{
    st->MemSink_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(m, &MemSink_spec, NULL);
    if (st->MemSink_type == NULL || PyModule_AddType(m, st->MemSink_type) < 0)
        return -1;
    return 0;
}
