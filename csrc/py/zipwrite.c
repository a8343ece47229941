/* zipwrite.c - the RecordPlan type: a Python handle on an ss_zip_plan
 * (a tensor record's torch.save framing, ss_zipwrite.h), which
 * write_records (io.c) takes by index for each tensor record.
 */
#include "module.h"

#include "ss_zipwrite.h"

typedef struct {
    PyObject_HEAD
    ss_zip_plan *plan;
    PyObject *header;   /* bytes */
    PyObject *template; /* bytes: the trailer for CRC 0 */
} RecordPlanObject;

/* n int64s >= 0 from a sequence of ints; what names it in errors. */
static int dims(PyObject *obj, const char *what, int64_t *out, size_t *n)
{
    PyObject *seq = PySequence_Fast(obj, "");
    int rc = -1;

    if (seq == NULL) {
        PyErr_Format(PyExc_TypeError, "%s must be a sequence of ints", what);
        return -1;
    }
    if (PySequence_Fast_GET_SIZE(seq) > SS_ZIP_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "%s has more than %d dimensions", what,
                     SS_ZIP_MAX_NDIM);
        goto out;
    }
    *n = (size_t)PySequence_Fast_GET_SIZE(seq);
    for (size_t i = 0; i < *n; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v == -1 && PyErr_Occurred())
            goto out;
        out[i] = v;
    }
    rc = 0;
out:
    Py_DECREF(seq);
    return rc;
}

static PyObject *RecordPlan_new(PyTypeObject *type, PyObject *args,
                                PyObject *kwds)
{
    static char *kwlist[] = {"dtype", "shape", "stride", "storage_numel", NULL};
    const char *dtype = NULL;
    PyObject *shape_obj, *stride_obj = Py_None, *numel_obj = Py_None;
    int64_t shape[SS_ZIP_MAX_NDIM], stride[SS_ZIP_MAX_NDIM];
    size_t ndim = 0, nstride = 0;
    long long numel = -1;
    ss_zip_plan *plan = NULL;
    RecordPlanObject *self;
    size_t hl, tl;
    int rc;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sO|OO:RecordPlan", kwlist,
                                     &dtype, &shape_obj, &stride_obj,
                                     &numel_obj) ||
        dims(shape_obj, "shape", shape, &ndim) < 0 ||
        (stride_obj != Py_None &&
         dims(stride_obj, "stride", stride, &nstride) < 0))
        return NULL;
    if (stride_obj != Py_None && nstride != ndim)
        return PyErr_Format(PyExc_ValueError,
                            "stride %R does not match shape %R", stride_obj,
                            shape_obj);
    if (numel_obj != Py_None) {
        numel = PyLong_AsLongLong(numel_obj);
        if (numel == -1 && PyErr_Occurred())
            return NULL;
        if (numel < 0)
            return PyErr_Format(PyExc_ValueError,
                                "storage_numel must be >= 0, got %lld", numel);
    }
    rc = ss_zip_plan_new(dtype, ndim, shape,
                         stride_obj != Py_None ? stride : NULL, numel, &plan);
    if (rc == SS_ENOMEM)
        return PyErr_NoMemory();
    if (rc < 0)
        return PyErr_Format(PyExc_ValueError,
                            "no torch.save record for dtype %s, shape %R, "
                            "stride %R, storage_numel %R (unknown dtype, "
                            "negative sizes, or a storage too small for the "
                            "strides)",
                            dtype, shape_obj, stride_obj, numel_obj);
    self = (RecordPlanObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        ss_zip_plan_free(plan);
        return NULL;
    }
    self->plan = plan;
    const uint8_t *h = ss_zip_plan_header(plan, &hl);
    const uint8_t *t = ss_zip_plan_trailer(plan, &tl);
    self->header = PyBytes_FromStringAndSize((const char *)h, (Py_ssize_t)hl);
    self->template = PyBytes_FromStringAndSize((const char *)t, (Py_ssize_t)tl);
    if (self->header == NULL || self->template == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void RecordPlan_dealloc(RecordPlanObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    ss_zip_plan_free(self->plan);
    Py_XDECREF(self->header);
    Py_XDECREF(self->template);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *RecordPlan_trailer(RecordPlanObject *self, PyObject *arg)
{
    unsigned long crc = PyLong_AsUnsignedLong(arg);
    PyObject *out;

    if ((crc == (unsigned long)-1 && PyErr_Occurred()) || crc > 0xFFFFFFFFul) {
        PyErr_Clear();
        return PyErr_Format(PyExc_ValueError,
                            "crc must be an unsigned 32-bit value, got %R",
                            arg);
    }
    out = PyBytes_FromStringAndSize(PyBytes_AS_STRING(self->template),
                                    PyBytes_GET_SIZE(self->template));
    if (out != NULL)
        ss_zip_plan_patch(self->plan, (uint8_t *)PyBytes_AS_STRING(out),
                          (uint32_t)crc);
    return out;
}

static PyObject *get_header(RecordPlanObject *self, void *c)
{
    (void)c;
    return Py_NewRef(self->header);
}

static PyObject *get_template(RecordPlanObject *self, void *c)
{
    (void)c;
    return Py_NewRef(self->template);
}

static PyObject *get_data_offset(RecordPlanObject *self, void *c)
{
    (void)c;
    return PyLong_FromSsize_t(PyBytes_GET_SIZE(self->header));
}

static PyObject *get_data_length(RecordPlanObject *self, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong(ss_zip_plan_data_length(self->plan));
}

static PyObject *get_total_length(RecordPlanObject *self, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong(ss_zip_plan_total_length(self->plan));
}

static PyMethodDef RecordPlan_methods[] = {
    {"trailer", (PyCFunction)RecordPlan_trailer, METH_O,
     "trailer(crc)\n--\n\nThe trailer for the data's CRC-32 crc."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef RecordPlan_getset[] = {
    {"header", (getter)get_header, NULL,
     "Everything before the storage bytes (bytes).", NULL},
    {"template", (getter)get_template, NULL, "The trailer for CRC 0 (bytes).",
     NULL},
    {"data_offset", (getter)get_data_offset, NULL,
     "Where the storage bytes start in the record (len(header)).", NULL},
    {"data_length", (getter)get_data_length, NULL, "The storage bytes' length.",
     NULL},
    {"total_length", (getter)get_total_length, NULL, "header + data + trailer.",
     NULL},
    {NULL},
};

static PyType_Slot RecordPlan_slots[] = {
    {Py_tp_new, RecordPlan_new},
    {Py_tp_dealloc, RecordPlan_dealloc},
    {Py_tp_methods, RecordPlan_methods},
    {Py_tp_getset, RecordPlan_getset},
    {Py_tp_doc, "RecordPlan(dtype, shape, stride=None, storage_numel=None)"
                "\n--\n\n"
                "The torch.save framing of one tensor record (torch 2.13's "
                "bytes for a CPU tensor with storage offset 0): header, "
                "and trailer(crc) for the storage bytes' CRC-32. stride "
                "None is contiguous; storage_numel None is the span the "
                "strides reach."},
    {0, NULL},
};

static PyType_Spec RecordPlan_spec = {
    .name = "shardstate._core.RecordPlan",
    .basicsize = sizeof(RecordPlanObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = RecordPlan_slots,
};

int ss_py_zip_plan_arg(ss_state *st, PyObject *obj,
                       const struct ss_zip_plan **out)
{
    if (!PyObject_TypeCheck(obj, st->RecordPlan_type)) {
        PyErr_Format(PyExc_TypeError, "expected a RecordPlan, got %.200s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    *out = ((RecordPlanObject *)obj)->plan;
    return 0;
}

int ss_py_zipwrite_init(PyObject *m, ss_state *st)
{
    st->RecordPlan_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(m, &RecordPlan_spec, NULL);
    if (st->RecordPlan_type == NULL)
        return -1;
    return PyModule_AddType(m, st->RecordPlan_type);
}
