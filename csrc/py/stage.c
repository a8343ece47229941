/* stage.c - the Stage type: a Python handle on an ss_stage (the pinned
 * staging buffers and copy stream for device jobs of write_batch /
 * read_batch) and the backend it runs on.
 *
 * Backends: "host", ss_devhost (device memory is host memory: the
 * pipeline on machines without a GPU, and its tests). Device buffers are
 * taken from Python objects by ss_py_stage_buffer, per backend.
 */
#include "module.h"

#include "ss_devhost.h"
#include "ss_stage.h"

typedef struct {
    PyObject_HEAD
    ss_stage *stage;
    ss_devhost *host; /* the "host" backend */
    const char *backend;
} StageObject;

static PyObject *Stage_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"backend", "buffers", "buffer_size", NULL};
    const char *backend = NULL;
    Py_ssize_t nbufs = 0, bufsize = 0;
    StageObject *self = NULL;
    ss_errinfo info;
    int rc = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "snn:Stage", kwlist, &backend,
                                     &nbufs, &bufsize))
        return NULL;
    if (strcmp(backend, "host") != 0)
        return PyErr_Format(PyExc_ValueError,
                            "Stage backend must be 'host', got %R",
                            PyTuple_GET_ITEM(args, 0));
    if (nbufs < 1 || nbufs > 4096 || bufsize < 4096)
        return PyErr_Format(PyExc_ValueError,
                            "Stage needs 1 to 4096 buffers of at least 4096 "
                            "bytes, got %zd of %zd", nbufs, bufsize);
    self = (StageObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->backend = "host";
    Py_BEGIN_ALLOW_THREADS
    rc = ss_devhost_new(&self->host);
    if (rc == 0)
        rc = ss_stage_new(&self->stage, ss_devhost_dev(self->host),
                          (size_t)nbufs, (size_t)bufsize);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        ss_errinfo_clear(&info);
        ss_errinfo_set(&info, rc, "stage", NULL, -1, NULL);
        Py_DECREF(self);
        return ss_py_raise(ss_state_from_type(type), rc, &info);
    }
    return (PyObject *)self;
}

static void Stage_dealloc(StageObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    ss_stage *stage = self->stage;
    ss_devhost *host = self->host;
    self->stage = NULL;
    self->host = NULL;
    Py_BEGIN_ALLOW_THREADS
    ss_stage_free(stage); /* joins the copy stream */
    ss_devhost_free(host);
    Py_END_ALLOW_THREADS
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *Stage_get_backend(StageObject *self, void *c)
{
    (void)c;
    return PyUnicode_FromString(self->backend);
}

static PyObject *Stage_get_buffers(StageObject *self, void *c)
{
    (void)c;
    return PyLong_FromSize_t(ss_stage_nbufs(self->stage));
}

static PyObject *Stage_get_buffer_size(StageObject *self, void *c)
{
    (void)c;
    return PyLong_FromSize_t(ss_stage_bufsize(self->stage));
}

static PyObject *Stage_get_copies(StageObject *self, void *c)
{
    (void)c;
    return PyLong_FromLong(self->host != NULL ? ss_devhost_completed(self->host)
                                              : -1);
}

static PyObject *Stage_repr(StageObject *self)
{
    return PyUnicode_FromFormat("<shardstate Stage backend=%s buffers=%zu "
                                "buffer_size=%zu>", self->backend,
                                ss_stage_nbufs(self->stage),
                                ss_stage_bufsize(self->stage));
}

static PyGetSetDef Stage_getset[] = {
    {"backend", (getter)Stage_get_backend, NULL, "The copy backend.", NULL},
    {"buffers", (getter)Stage_get_buffers, NULL,
     "Number of staging buffers.", NULL},
    {"buffer_size", (getter)Stage_get_buffer_size, NULL,
     "Bytes per staging buffer (device pieces are cut to it).", NULL},
    {"copies", (getter)Stage_get_copies, NULL,
     "Copies the backend has completed (host backend; -1 otherwise).", NULL},
    {NULL},
};

static PyType_Slot Stage_slots[] = {
    {Py_tp_new, Stage_new},
    {Py_tp_dealloc, Stage_dealloc},
    {Py_tp_repr, Stage_repr},
    {Py_tp_getset, Stage_getset},
    {Py_tp_doc, "Stage(backend, buffers, buffer_size)\n--\n\n"
                "Staging buffers and a copy stream for the device jobs of "
                "write_batch / read_batch. One batch at a time."},
    {0, NULL},
};

static PyType_Spec Stage_spec = {
    .name = "shardstate._core.Stage",
    .basicsize = sizeof(StageObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Stage_slots,
};

int ss_py_stage_arg(ss_state *st, PyObject *obj, ss_stage **out)
{
    if (obj == Py_None) {
        *out = NULL;
        return 0;
    }
    if (!PyObject_TypeCheck(obj, st->Stage_type)) {
        PyErr_Format(PyExc_TypeError, "expected a Stage or None, got %.200s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    *out = ((StageObject *)obj)->stage;
    return 0;
}

int ss_py_stage_init(PyObject *m, ss_state *st)
{
    st->Stage_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Stage_spec,
                                                              NULL);
    if (st->Stage_type == NULL)
        return -1;
    return PyModule_AddType(m, st->Stage_type);
}
