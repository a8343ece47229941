/* pool.c - the ThreadPool type: a Python handle on an ss_pool.
 * The pool is freed (workers joined) when the object is deallocated. */
#include "module.h"

typedef struct {
    PyObject_HEAD
    ss_pool *pool;
} ThreadPoolObject;

static PyObject *ThreadPool_new(PyTypeObject *type, PyObject *args,
                                PyObject *kwds)
{
    static char *kwlist[] = {"threads", NULL};
    int nthreads = 0, rc;
    ThreadPoolObject *self;
    ss_pool *pool = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i:ThreadPool", kwlist,
                                     &nthreads))
        return NULL;
    if (nthreads < 0 || nthreads > SS_POOL_MAX_THREADS)
        return PyErr_Format(PyExc_ValueError,
                            "threads must be in [0, %d], got %d",
                            SS_POOL_MAX_THREADS, nthreads);
    Py_BEGIN_ALLOW_THREADS
        rc = ss_pool_new(&pool, nthreads);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        ss_errinfo info;
        ss_errinfo_clear(&info);
        ss_errinfo_set(&info, rc, "pthread_create", NULL, -1, NULL);
        return ss_py_raise(ss_state_from_type(type), rc, &info);
    }
    self = (ThreadPoolObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        ss_pool_free(pool);
        return NULL;
    }
    self->pool = pool;
    return (PyObject *)self;
}

static void ThreadPool_dealloc(ThreadPoolObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    ss_pool *pool = self->pool;
    self->pool = NULL;
    if (pool != NULL) {
        Py_BEGIN_ALLOW_THREADS
            ss_pool_free(pool);
        Py_END_ALLOW_THREADS
    }
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *ThreadPool_get_threads(ThreadPoolObject *self, void *c)
{
    (void)c;
    return PyLong_FromLong(ss_pool_threads(self->pool));
}

static PyObject *ThreadPool_repr(ThreadPoolObject *self)
{
    return PyUnicode_FromFormat("<shardstate ThreadPool threads=%d>",
                                ss_pool_threads(self->pool));
}

static PyGetSetDef ThreadPool_getset[] = {
    {"threads", (getter)ThreadPool_get_threads, NULL,
     "Number of worker threads (the calling thread helps too).", NULL},
    {NULL},
};

static PyType_Slot ThreadPool_slots[] = {
    {Py_tp_new, ThreadPool_new},
    {Py_tp_dealloc, ThreadPool_dealloc},
    {Py_tp_repr, ThreadPool_repr},
    {Py_tp_getset, ThreadPool_getset},
    {Py_tp_doc, "ThreadPool(threads)\n--\n\n"
                "A pool of C worker threads used by the core's batch "
                "operations. The calling thread also works, so threads=0 "
                "runs serially."},
    {0, NULL},
};

static PyType_Spec ThreadPool_spec = {
    .name = "shardstate._core.ThreadPool",
    .basicsize = sizeof(ThreadPoolObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = ThreadPool_slots,
};

int ss_py_pool_arg(ss_state *st, PyObject *obj, ss_pool **out)
{
    if (obj == Py_None) {
        *out = NULL;
        return 0;
    }
    if (!PyObject_TypeCheck(obj, st->ThreadPool_type)) {
        PyErr_Format(PyExc_TypeError,
                     "expected a ThreadPool or None, got %.200s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    *out = ((ThreadPoolObject *)obj)->pool;
    return 0;
}

int ss_py_pool_init(PyObject *m, ss_state *st)
{
    st->ThreadPool_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(m, &ThreadPool_spec, NULL);
    if (st->ThreadPool_type == NULL)
        return -1;
    return PyModule_AddType(m, st->ThreadPool_type);
}
