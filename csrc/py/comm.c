/* comm.c - the NcclComm type (an ss_comm: an NCCL communicator with its
 * own stream) and nccl_unique_id(). Buffers are device memory given by
 * __cuda_array_interface__; the GIL is released around every CUDA and
 * NCCL call, and one call runs at a time per communicator. */
#include "module.h"

#include "ss_comm.h"

#include <pythread.h>

typedef struct {
    PyObject_HEAD
    ss_comm *comm;
    PyThread_type_lock lock;
} NcclCommObject;

static PyObject *NcclComm_new(PyTypeObject *type, PyObject *args,
                              PyObject *kwds)
{
    static char *kwlist[] = {"nranks", "rank", "unique_id", "device",
                             "cudart", "nccl", NULL};
    ss_state *st = ss_state_from_type(type);
    int nranks = 0, rank = 0, device = 0, rc = 0;
    Py_buffer id = {0};
    PyObject *cudart = Py_None, *nccl = Py_None;
    const ss_cuda *cu = NULL;
    const ss_nccl *nc = NULL;
    NcclCommObject *self = NULL;
    ss_errinfo info;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iiy*|iOO:NcclComm", kwlist,
                                     &nranks, &rank, &id, &device, &cudart,
                                     &nccl))
        return NULL;
    if (id.len != SS_NCCL_UNIQUE_ID_BYTES) {
        PyErr_Format(PyExc_ValueError, "unique_id must be %d bytes, got %zd",
                     SS_NCCL_UNIQUE_ID_BYTES, id.len);
        goto out;
    }
    if (nranks < 1 || rank < 0 || rank >= nranks || device < 0) {
        PyErr_Format(PyExc_ValueError,
                     "NcclComm needs 0 <= rank < nranks and device >= 0, got "
                     "rank %d of %d on device %d",
                     rank, nranks, device);
        goto out;
    }
    if (ss_py_load_libs(st, "NcclComm", cudart, nccl, &cu, &nc) < 0)
        goto out;
    self = (NcclCommObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        goto out;
    self->lock = PyThread_allocate_lock();
    if (self->lock == NULL) {
        Py_CLEAR(self);
        PyErr_NoMemory();
        goto out;
    }
    ss_errinfo_clear(&info);
    Py_BEGIN_ALLOW_THREADS
        rc = ss_comm_new(&self->comm, nc, cu, device, nranks, rank,
                         (const unsigned char *)id.buf, &info);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        Py_CLEAR(self);
        ss_py_raise(st, rc, &info);
    }
out:
    PyBuffer_Release(&id);
    return (PyObject *)self;
}

static void NcclComm_dealloc(NcclCommObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    ss_comm *c = self->comm;
    self->comm = NULL;
    if (c != NULL) {
        Py_BEGIN_ALLOW_THREADS
            ss_comm_free(c);
        Py_END_ALLOW_THREADS
    }
    if (self->lock != NULL)
        PyThread_free_lock(self->lock);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int take(NcclCommObject *self)
{
    if (!PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) {
        Py_BEGIN_ALLOW_THREADS
            PyThread_acquire_lock(self->lock, WAIT_LOCK);
        Py_END_ALLOW_THREADS
    }
    if (self->comm == NULL) {
        PyThread_release_lock(self->lock);
        PyErr_SetString(PyExc_ValueError, "the communicator is closed");
        return -1;
    }
    return 0;
}

enum { OP_ALL_GATHER, OP_BROADCAST, OP_SCATTER, OP_GATHER };

static PyObject *collective(NcclCommObject *self, int op, PyObject *args,
                            PyObject *kwds)
{
    static char *kw_ag[] = {"send", "recv", "stream", "wait", NULL};
    static char *kw_bc[] = {"buf", "root", "stream", "wait", NULL};
    static char *kw_sc[] = {"send", "recv", "root", "stream", "wait", NULL};
    static char *kw_ga[] = {"send", "recv", "root", "stream", "wait", NULL};
    ss_state *st = ss_state_from_type(Py_TYPE(self));
    PyObject *send = Py_None, *recv = Py_None, *stream_obj = Py_None;
    void *sp = NULL, *rp = NULL, *stream = NULL;
    Py_ssize_t sn = 0, rn = 0;
    int root = 0, wait = 0, rc, nranks;
    ss_errinfo info;

    if ((op == OP_ALL_GATHER &&
         !PyArg_ParseTupleAndKeywords(args, kwds, "OO|Op:all_gather", kw_ag,
                                      &send, &recv, &stream_obj, &wait)) ||
        (op == OP_BROADCAST &&
         !PyArg_ParseTupleAndKeywords(args, kwds, "Oi|Op:broadcast", kw_bc,
                                      &recv, &root, &stream_obj, &wait)) ||
        (op == OP_SCATTER && !PyArg_ParseTupleAndKeywords(
                                 args, kwds, "OOi|Op:scatter", kw_sc, &send,
                                 &recv, &root, &stream_obj, &wait)) ||
        (op == OP_GATHER &&
         !PyArg_ParseTupleAndKeywords(args, kwds, "OOi|Op:gather", kw_ga, &send,
                                      &recv, &root, &stream_obj, &wait)))
        return NULL;
    if (ss_py_stream_arg(stream_obj, &stream) < 0 || take(self) < 0)
        return NULL;
    nranks = ss_comm_nranks(self->comm);
    if ((recv != Py_None || op != OP_GATHER) &&
        ss_py_cai_buffer(recv, op == OP_BROADCAST ? "buf" : "recv", 1, &rp,
                         &rn) < 0)
        goto fail;
    if (send != Py_None && ss_py_cai_buffer(send, "send", 0, &sp, &sn) < 0)
        goto fail;
    if (op == OP_GATHER &&
        (send == Py_None || (ss_comm_rank(self->comm) == root &&
                             (recv == Py_None || rn != sn * nranks)))) {
        PyErr_Format(PyExc_ValueError,
                     "gather: send is required, and the root's "
                     "recv must hold nranks (%d) x len(send) bytes",
                     nranks);
        goto fail;
    }
    if (op == OP_ALL_GATHER && (send == Py_None || rn != sn * nranks)) {
        PyErr_Format(PyExc_ValueError,
                     "all_gather: recv must hold nranks (%d) x "
                     "len(send) = %zd bytes, got %zd",
                     nranks, sn * nranks, rn);
        goto fail;
    }
    if (op == OP_SCATTER && ss_comm_rank(self->comm) == root &&
        (send == Py_None || sn != rn * nranks)) {
        PyErr_Format(PyExc_ValueError,
                     "scatter: the root's send must hold nranks "
                     "(%d) x len(recv) = %zd bytes",
                     nranks, rn * nranks);
        goto fail;
    }
    if (op != OP_ALL_GATHER && (root < 0 || root >= nranks)) {
        PyErr_Format(PyExc_ValueError, "root %d is not a rank of %d", root,
                     nranks);
        goto fail;
    }
    ss_errinfo_clear(&info);
    Py_BEGIN_ALLOW_THREADS
        switch (op) {
        case OP_ALL_GATHER:
            rc = ss_comm_all_gather(self->comm, sp, rp, (size_t)sn, stream,
                                    wait, &info);
            break;
        case OP_BROADCAST:
            rc = ss_comm_broadcast(self->comm, rp, (size_t)rn, root, stream,
                                   wait, &info);
            break;
        case OP_SCATTER:
            rc = ss_comm_scatter(self->comm, sp, rp, (size_t)rn, root, stream,
                                 wait, &info);
            break;
        default:
            rc = ss_comm_gather(self->comm, sp, rp, (size_t)sn, root, stream,
                                wait, &info);
        }
    Py_END_ALLOW_THREADS
    PyThread_release_lock(self->lock);
    if (rc < 0)
        return ss_py_raise(st, rc, &info);
    Py_RETURN_NONE;
fail:
    PyThread_release_lock(self->lock);
    return NULL;
}

static PyObject *NcclComm_all_gather(NcclCommObject *self, PyObject *a,
                                     PyObject *k)
{
    return collective(self, OP_ALL_GATHER, a, k);
}

static PyObject *NcclComm_broadcast(NcclCommObject *self, PyObject *a,
                                    PyObject *k)
{
    return collective(self, OP_BROADCAST, a, k);
}

static PyObject *NcclComm_scatter(NcclCommObject *self, PyObject *a,
                                  PyObject *k)
{
    return collective(self, OP_SCATTER, a, k);
}

static PyObject *NcclComm_gather(NcclCommObject *self, PyObject *a, PyObject *k)
{
    return collective(self, OP_GATHER, a, k);
}

static PyObject *NcclComm_close(NcclCommObject *self, PyObject *unused)
{
    ss_comm *c;
    (void)unused;
    if (!PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) {
        Py_BEGIN_ALLOW_THREADS
            PyThread_acquire_lock(self->lock, WAIT_LOCK);
        Py_END_ALLOW_THREADS
    }
    c = self->comm;
    self->comm = NULL;
    PyThread_release_lock(self->lock);
    if (c != NULL) {
        Py_BEGIN_ALLOW_THREADS
            ss_comm_free(c);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *get_int(NcclCommObject *self, int which)
{
    if (self->comm == NULL) {
        PyErr_SetString(PyExc_ValueError, "the communicator is closed");
        return NULL;
    }
    return PyLong_FromLong(which == 0   ? ss_comm_nranks(self->comm)
                           : which == 1 ? ss_comm_rank(self->comm)
                                        : ss_comm_device(self->comm));
}

static PyObject *NcclComm_get_nranks(NcclCommObject *self, void *c)
{
    (void)c;
    return get_int(self, 0);
}

static PyObject *NcclComm_get_rank(NcclCommObject *self, void *c)
{
    (void)c;
    return get_int(self, 1);
}

static PyObject *NcclComm_get_device(NcclCommObject *self, void *c)
{
    (void)c;
    return get_int(self, 2);
}

static PyObject *NcclComm_get_closed(NcclCommObject *self, void *c)
{
    (void)c;
    return PyBool_FromLong(self->comm == NULL);
}

static PyMethodDef NcclComm_methods[] = {
    {"all_gather", (PyCFunction)(void (*)(void))NcclComm_all_gather,
     METH_VARARGS | METH_KEYWORDS,
     "all_gather(send, recv, stream=None, wait=False)\n--\n\n"
     "Every rank's send bytes into recv, in rank order."},
    {"broadcast", (PyCFunction)(void (*)(void))NcclComm_broadcast,
     METH_VARARGS | METH_KEYWORDS,
     "broadcast(buf, root, stream=None, wait=False)\n--\n\n"
     "root's buf bytes into every rank's buf."},
    {"scatter", (PyCFunction)(void (*)(void))NcclComm_scatter,
     METH_VARARGS | METH_KEYWORDS,
     "scatter(send, recv, root, stream=None, wait=False)\n--\n\n"
     "Block r of root's send (nranks x len(recv) bytes) into rank r's recv."},
    {"gather", (PyCFunction)(void (*)(void))NcclComm_gather,
     METH_VARARGS | METH_KEYWORDS,
     "gather(send, recv, root, stream=None, wait=False)\n--\n\n"
     "Every rank's send bytes into root's recv (nranks x len(send)) in rank "
     "order; recv is None on the other ranks."},
    {"close", (PyCFunction)NcclComm_close, METH_NOARGS,
     "close()\n--\n\nDestroy the communicator (abort it after an error)."},
    {NULL},
};

static PyGetSetDef NcclComm_getset[] = {
    {"nranks", (getter)NcclComm_get_nranks, NULL, "Ranks in the communicator.",
     NULL},
    {"rank", (getter)NcclComm_get_rank, NULL, "This rank.", NULL},
    {"device", (getter)NcclComm_get_device, NULL, "The CUDA device.", NULL},
    {"closed", (getter)NcclComm_get_closed, NULL, "Whether close() was called.",
     NULL},
    {NULL},
};

static PyType_Slot NcclComm_slots[] = {
    {Py_tp_new, NcclComm_new},
    {Py_tp_dealloc, NcclComm_dealloc},
    {Py_tp_methods, NcclComm_methods},
    {Py_tp_getset, NcclComm_getset},
    {Py_tp_doc, "NcclComm(nranks, rank, unique_id, device=0, cudart=None, "
                "nccl=None)\n--\n\n"
                "An NCCL communicator with its own stream. Every member "
                "passes the same unique_id (from nccl_unique_id()). Buffers "
                "are device memory with __cuda_array_interface__; a "
                "collective is ordered after the work on `stream` (an int "
                "handle, None: the default stream) and that stream waits "
                "for it; with wait=True the call returns when it is done."},
    {0, NULL},
};

static PyType_Spec NcclComm_spec = {
    .name = "shardstate._core.NcclComm",
    .basicsize = sizeof(NcclCommObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = NcclComm_slots,
};

static PyObject *py_nccl_unique_id(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"cudart", "nccl", NULL};
    ss_state *st = ss_get_state(m);
    PyObject *cudart = Py_None, *nccl = Py_None;
    const ss_cuda *cu = NULL;
    const ss_nccl *nc = NULL;
    unsigned char id[SS_NCCL_UNIQUE_ID_BYTES];
    ss_errinfo info;
    int rc;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OO:nccl_unique_id", kwlist,
                                     &cudart, &nccl) ||
        ss_py_load_libs(st, "nccl_unique_id", cudart, nccl, &cu, &nc) < 0)
        return NULL;
    ss_errinfo_clear(&info);
    Py_BEGIN_ALLOW_THREADS
        rc = ss_comm_unique_id(nc, id, &info);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return ss_py_raise(st, rc, &info);
    return PyBytes_FromStringAndSize((const char *)id, sizeof id);
}

static PyMethodDef comm_functions[] = {
    {"nccl_unique_id", (PyCFunction)(void (*)(void))py_nccl_unique_id,
     METH_VARARGS | METH_KEYWORDS,
     "nccl_unique_id(cudart=None, nccl=None)\n--\n\n"
     "A new NCCL unique id (bytes) for NcclComm; cudart / nccl are library "
     "candidates (None: the default names)."},
    {NULL},
};

int ss_py_comm_init(PyObject *m, ss_state *st)
{
    st->NcclComm_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(m, &NcclComm_spec, NULL);
    if (st->NcclComm_type == NULL || PyModule_AddType(m, st->NcclComm_type) < 0)
        return -1;
    return PyModule_AddFunctions(m, comm_functions);
}
