/* stage.c - the Stage type: a Python handle on an ss_stage (the pinned
 * staging buffers and copy stream for device jobs of write_batch /
 * read_batch) and the backend it runs on.
 *
 * Backends: "cuda", ss_devcuda on the libcudart that ss_cuda loads (device
 * buffers come from __cuda_array_interface__, see io.c); "host", ss_devhost
 * (device memory is host memory, taken through the buffer protocol: the
 * pipeline on machines without a GPU, and its tests).
 */
#include "module.h"

#include "ss_cuda.h"
#include "ss_devcuda.h"
#include "ss_devhost.h"
#include "ss_stage.h"

typedef struct {
    PyObject_HEAD
    ss_stage *stage;
    ss_devhost *host; /* the "host" backend */
    ss_devcuda *cuda; /* the "cuda" backend */
    int device;
    const char *backend;
} StageObject;

static PyObject *Stage_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"backend", "buffers",    "buffer_size",
                             "device",  "candidates", NULL};
    ss_state *st = ss_state_from_type(type);
    const char *backend = NULL;
    Py_ssize_t nbufs = 0, bufsize = 0;
    int device = 0, rc = 0, cuda;
    PyObject *cand_obj = Py_None;
    const ss_cuda *cu = NULL;
    StageObject *self = NULL;
    ss_errinfo info;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "snn|iO:Stage", kwlist,
                                     &backend, &nbufs, &bufsize, &device,
                                     &cand_obj))
        return NULL;
    cuda = strcmp(backend, "cuda") == 0;
    if (!cuda && strcmp(backend, "host") != 0)
        return PyErr_Format(PyExc_ValueError,
                            "Stage backend must be 'host' or 'cuda', got %R",
                            PyTuple_GET_ITEM(args, 0));
    if (nbufs < 1 || nbufs > 4096 || bufsize < 4096)
        return PyErr_Format(PyExc_ValueError,
                            "Stage needs 1 to 4096 buffers of at least 4096 "
                            "bytes, got %zd of %zd",
                            nbufs, bufsize);
    if (device < 0)
        return PyErr_Format(PyExc_ValueError, "device must be >= 0, got %d",
                            device);
    if (cuda && ss_py_load_libs(st, "Stage", cand_obj, Py_None, &cu, NULL) < 0)
        return NULL;
    self = (StageObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->backend = cuda ? "cuda" : "host";
    self->device = device;
    ss_errinfo_clear(&info);
    Py_BEGIN_ALLOW_THREADS
        if (cuda) {
            rc = ss_devcuda_new(&self->cuda, cu, device, &info);
            if (rc == 0)
                rc = ss_stage_new(&self->stage, ss_devcuda_dev(self->cuda),
                                  (size_t)nbufs, (size_t)bufsize);
        } else {
            rc = ss_devhost_new(&self->host);
            if (rc == 0)
                rc = ss_stage_new(&self->stage, ss_devhost_dev(self->host),
                                  (size_t)nbufs, (size_t)bufsize);
        }
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        if (info.code == 0) /* else ss_devcuda_new described it */
            ss_errinfo_set(&info, rc, "stage", NULL, -1, NULL);
        Py_DECREF(self);
        return ss_py_raise(st, rc, &info);
    }
    return (PyObject *)self;
}

static void Stage_dealloc(StageObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    ss_stage *stage = self->stage;
    ss_devhost *host = self->host;
    ss_devcuda *cuda = self->cuda;
    self->stage = NULL;
    self->host = NULL;
    self->cuda = NULL;
    Py_BEGIN_ALLOW_THREADS
        ss_stage_free(stage); /* drains and frees the copy stream */
        ss_devhost_free(host);
        ss_devcuda_free(cuda);
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

static PyObject *Stage_get_device(StageObject *self, void *c)
{
    (void)c;
    return PyLong_FromLong(self->device);
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
                                "buffer_size=%zu>",
                                self->backend, ss_stage_nbufs(self->stage),
                                ss_stage_bufsize(self->stage));
}

static PyGetSetDef Stage_getset[] = {
    {"backend", (getter)Stage_get_backend, NULL, "The copy backend.", NULL},
    {"buffers", (getter)Stage_get_buffers, NULL, "Number of staging buffers.",
     NULL},
    {"buffer_size", (getter)Stage_get_buffer_size, NULL,
     "Bytes per staging buffer (device pieces are cut to it).", NULL},
    {"device", (getter)Stage_get_device, NULL,
     "The CUDA device ordinal (0 for the host backend).", NULL},
    {"copies", (getter)Stage_get_copies, NULL,
     "Copies the backend has completed (host backend; -1 otherwise).", NULL},
    {NULL},
};

static PyType_Slot Stage_slots[] = {
    {Py_tp_new, Stage_new},
    {Py_tp_dealloc, Stage_dealloc},
    {Py_tp_repr, Stage_repr},
    {Py_tp_getset, Stage_getset},
    {Py_tp_doc, "Stage(backend, buffers, buffer_size, device=0, "
                "candidates=None)\n--\n\n"
                "Staging buffers and a copy stream for the device jobs of "
                "write_batch / read_batch; batches take turns. backend "
                "'cuda' loads libcudart from candidates (paths or names; "
                "None: the default sonames) and stages through pinned "
                "buffers on the given device; 'host' is the same pipeline "
                "on host memory."},
    {0, NULL},
};

static PyType_Spec Stage_spec = {
    .name = "shardstate._core.Stage",
    .basicsize = sizeof(StageObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Stage_slots,
};

int ss_py_stage_arg(ss_state *st, PyObject *obj, ss_stage **out, int *cuda)
{
    *cuda = 0;
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
    *cuda = ((StageObject *)obj)->cuda != NULL;
    return 0;
}

int ss_py_stage_init(PyObject *m, ss_state *st)
{
    st->Stage_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(m, &Stage_spec, NULL);
    if (st->Stage_type == NULL)
        return -1;
    return PyModule_AddType(m, st->Stage_type);
}
