/* faults.c - the FaultInjector type over an ss_faults.
 *
 * Passing one as `faults` to a batch or a file operation routes its system
 * calls through it. Its methods may be called from any thread, even while
 * a call that uses it runs.
 */
#include "module.h"
#include "ss_os.h"

typedef struct {
    PyObject_HEAD
    ss_faults *faults;
} FaultInjectorObject;

static PyObject *FaultInjector_new(PyTypeObject *type, PyObject *args,
                                   PyObject *kwds)
{
    FaultInjectorObject *self;

    if (!PyArg_ParseTuple(args, ":FaultInjector") ||
        (kwds != NULL && PyDict_GET_SIZE(kwds) > 0)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError,
                            "FaultInjector() takes no arguments");
        return NULL;
    }
    self = (FaultInjectorObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if (ss_faults_new(&self->faults, NULL) < 0) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void FaultInjector_dealloc(FaultInjectorObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    ss_faults_free(self->faults);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* The op named by a str, or -1 with ValueError set. */
static int op_arg(const char *name)
{
    int op = ss_os_op_from_name(name);
    if (op < 0) {
        PyObject *names = PyList_New(0);
        for (int i = 0; names != NULL && i < SS_OS_NOPS; i++) {
            PyObject *s = PyUnicode_FromString(ss_os_op_name(i));
            if (s == NULL || PyList_Append(names, s) < 0)
                Py_CLEAR(names);
            Py_XDECREF(s);
        }
        if (names != NULL) {
            PyErr_Format(PyExc_ValueError,
                         "unknown op '%s'; expected one of %R", name, names);
            Py_DECREF(names);
        }
    }
    return op;
}

static PyObject *arm_result(int rc, const char *what)
{
    if (rc < 0)
        return PyErr_Format(PyExc_ValueError,
                            "cannot arm %s: bad call number or value, or "
                            "more than %d arms",
                            what, SS_FAULTS_MAX_ARMS);
    Py_RETURN_NONE;
}

static PyObject *FaultInjector_fail(FaultInjectorObject *self, PyObject *args)
{
    const char *name;
    unsigned long long at;
    int err, op;
    if (!PyArg_ParseTuple(args, "sKi:fail", &name, &at, &err))
        return NULL;
    if ((op = op_arg(name)) < 0)
        return NULL;
    return arm_result(ss_faults_fail(self->faults, op, at, err), "fail");
}

static PyObject *FaultInjector_short(FaultInjectorObject *self, PyObject *args)
{
    const char *name;
    unsigned long long at;
    Py_ssize_t nbytes;
    int op;
    if (!PyArg_ParseTuple(args, "sKn:short", &name, &at, &nbytes))
        return NULL;
    if ((op = op_arg(name)) < 0)
        return NULL;
    if (nbytes < 0)
        return PyErr_Format(PyExc_ValueError, "nbytes must be >= 0");
    if (op != SS_OS_PWRITE && op != SS_OS_PREAD && op != SS_OS_PREADV)
        return PyErr_Format(PyExc_ValueError,
                            "short transfers apply to 'pwrite', 'pread' and "
                            "'preadv' only, not %R",
                            PyTuple_GET_ITEM(args, 0));
    return arm_result(ss_faults_short(self->faults, op, at, (size_t)nbytes),
                      "short");
}

static PyObject *FaultInjector_eintr(FaultInjectorObject *self, PyObject *args)
{
    const char *name;
    unsigned long long at;
    int op;
    if (!PyArg_ParseTuple(args, "sK:eintr", &name, &at))
        return NULL;
    if ((op = op_arg(name)) < 0)
        return NULL;
    return arm_result(ss_faults_eintr(self->faults, op, at), "eintr");
}

static PyObject *FaultInjector_kill(FaultInjectorObject *self, PyObject *args)
{
    const char *name;
    unsigned long long at;
    int op;
    if (!PyArg_ParseTuple(args, "sK:kill", &name, &at))
        return NULL;
    if ((op = op_arg(name)) < 0)
        return NULL;
    return arm_result(ss_faults_kill(self->faults, op, at), "kill");
}

static PyObject *FaultInjector_calls(FaultInjectorObject *self, PyObject *arg)
{
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    int op;
    if (name == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "calls(op): op must be a str");
        return NULL;
    }
    if ((op = op_arg(name)) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(ss_faults_calls(self->faults, op));
}

static PyObject *FaultInjector_reset(FaultInjectorObject *self, PyObject *u)
{
    (void)u;
    ss_faults_reset(self->faults);
    Py_RETURN_NONE;
}

static PyMethodDef FaultInjector_methods[] = {
    {"fail", (PyCFunction)FaultInjector_fail, METH_VARARGS,
     "fail(op, at_call, errno)\n--\n\nMake call number at_call (1-based) of "
     "op fail with errno."},
    {"short", (PyCFunction)FaultInjector_short, METH_VARARGS,
     "short(op, at_call, nbytes)\n--\n\nMake call at_call of 'pwrite', "
     "'pread' or 'preadv' transfer at most nbytes."},
    {"eintr", (PyCFunction)FaultInjector_eintr, METH_VARARGS,
     "eintr(op, at_call)\n--\n\nMake call at_call of op fail once with "
     "EINTR (the engine retries it)."},
    {"kill", (PyCFunction)FaultInjector_kill, METH_VARARGS,
     "kill(op, at_call)\n--\n\nMake call at_call of op send SIGKILL to "
     "this process instead (crash-consistency tests)."},
    {"calls", (PyCFunction)FaultInjector_calls, METH_O,
     "calls(op)\n--\n\nNumber of calls of op so far."},
    {"reset", (PyCFunction)FaultInjector_reset, METH_NOARGS,
     "reset()\n--\n\nDisarm everything and zero the counters."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot FaultInjector_slots[] = {
    {Py_tp_new, FaultInjector_new},
    {Py_tp_dealloc, FaultInjector_dealloc},
    {Py_tp_methods, FaultInjector_methods},
    {Py_tp_doc, "FaultInjector()\n--\n\n"
                "Counts the system calls of the batches it is passed to "
                "(faults=) and makes chosen ones fail, transfer short, "
                "report EINTR or kill the process. Ops: open, close, pwrite, "
                "pread, preadv, fsync, fstat, ftruncate, rename, unlink, "
                "fsync_dir, writeback, mmap, mkdir."},
    {0, NULL},
};

static PyType_Spec FaultInjector_spec = {
    .name = "shardstate._core.FaultInjector",
    .basicsize = sizeof(FaultInjectorObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = FaultInjector_slots,
};

/* obj is None or a FaultInjector: its vtable (NULL for None). */
int ss_py_faults_arg(ss_state *st, PyObject *obj, const ss_os **out)
{
    if (obj == Py_None) {
        *out = NULL;
        return 0;
    }
    if (ss_py_memsink_os(st, obj, out))
        return 0;
    if (!PyObject_TypeCheck(obj, st->FaultInjector_type)) {
        PyErr_Format(PyExc_TypeError,
                     "faults must be a FaultInjector, a MemSink or None, got "
                     "%.200s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    *out = ss_faults_os(((FaultInjectorObject *)obj)->faults);
    return 0;
}

int ss_py_faults_init(PyObject *m, ss_state *st)
{
    st->FaultInjector_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(m, &FaultInjector_spec, NULL);
    if (st->FaultInjector_type == NULL ||
        PyModule_AddType(m, st->FaultInjector_type) < 0)
        return -1;
    return 0;
}
