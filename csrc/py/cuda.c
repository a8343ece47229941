/* cuda.c - cuda_status(): the run-time CUDA runtime and NCCL loaders
 * (ss_cuda, ss_nccl) seen from Python, and the candidate parsing and
 * loading that Stage and NcclComm share with it.
 *
 * The candidates (override paths, sonames, extra directories) are chosen by
 * python/shardstate/cuda.py, which also reads the environment; None asks the
 * core for its default sonames. A library that is missing or refused is not
 * an error: the dict says so, with the reason. The GIL is released while the
 * libraries load and the devices are counted (both can take a while on the
 * first call). */
#include "module.h"
#include "ss_cuda.h"
#include "ss_nccl.h"

void ss_py_cands_release(ss_py_cands *c)
{
    Py_CLEAR(c->keep);
    PyMem_Free((void *)c->names);
    c->names = NULL;
    c->n = 0;
}

int ss_py_cands_from(PyObject *obj, const char *func, const char *argname,
                     ss_py_cands *c)
{
    PyObject *seq = NULL;
    Py_ssize_t i, n;
    int rc = -1;

    c->keep = NULL;
    c->names = NULL;
    c->n = 0;
    if (obj == Py_None)
        return 0;
    if (PyUnicode_Check(obj) || PyBytes_Check(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "%s(): %s must be None or a sequence of paths, "
                     "not a single %s",
                     func, argname, Py_TYPE(obj)->tp_name);
        return -1;
    }
    seq = PySequence_Fast(obj, "candidates must be a sequence");
    if (seq == NULL)
        return -1;
    n = PySequence_Fast_GET_SIZE(seq);
    if (n == 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): %s is empty: give at least one library "
                     "name or path, or None for the defaults",
                     func, argname);
        goto out;
    }
    c->keep = PyList_New(n);
    c->names = PyMem_Calloc((size_t)n, sizeof *c->names);
    if (c->keep == NULL || c->names == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (i = 0; i < n; i++) {
        PyObject *b = NULL;
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(seq, i), &b))
            goto out;
        PyList_SET_ITEM(c->keep, i, b);
        if (PyBytes_GET_SIZE(b) == 0) {
            PyErr_Format(PyExc_ValueError, "%s(): %s[%zd] is an empty path",
                         func, argname, i);
            goto out;
        }
        c->names[i] = PyBytes_AS_STRING(b);
    }
    c->n = (size_t)n;
    rc = 0;
out:
    Py_XDECREF(seq);
    if (rc < 0)
        ss_py_cands_release(c);
    return rc;
}

int ss_py_load_libs(ss_state *st, const char *func, PyObject *cudart,
                    PyObject *nccl, const ss_cuda **cu, const ss_nccl **nc)
{
    ss_py_cands cc = {0}, nn = {0};
    char *reason = NULL;
    int rc = -1, r = 0;

    if (ss_py_cands_from(cudart, func, "cudart", &cc) < 0 ||
        (nc != NULL && ss_py_cands_from(nccl, func, "nccl", &nn) < 0))
        goto out;
    reason = PyMem_Calloc(SS_DL_REASON_MAX, 1); /* 1 KiB: off the stack */
    if (reason == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    Py_BEGIN_ALLOW_THREADS
        r = ss_cuda_load(cc.names, cc.n, cu, reason, SS_DL_REASON_MAX);
        if (r == 0 && nc != NULL)
            r = ss_nccl_load(nn.names, nn.n, nc, reason, SS_DL_REASON_MAX);
    Py_END_ALLOW_THREADS
    if (r < 0) {
        ss_errinfo info;
        ss_errinfo_clear(&info);
        ss_errinfo_set(&info, r, "load", NULL, -1, "%s", reason);
        ss_py_raise(st, r, &info);
        goto out;
    }
    rc = 0;
out:
    PyMem_Free(reason);
    ss_py_cands_release(&cc);
    ss_py_cands_release(&nn);
    return rc;
}

/* Build a dict from "key", value pairs; steals nothing on failure. */
static PyObject *status_dict(const char *fmt, ...)
{
    va_list ap;
    PyObject *d;
    va_start(ap, fmt);
    d = Py_VaBuildValue(fmt, ap);
    va_end(ap);
    return d;
}

static PyObject *py_cuda_status(PyObject *m, PyObject *const *args,
                                Py_ssize_t nargs)
{
    ss_state *st = ss_get_state(m);
    ss_py_cands cu_c = {0}, nc_c = {0};
    ss_cuda_status *cs = NULL;
    ss_nccl_status *ns = NULL;
    PyObject *cu_d = NULL, *nc_d = NULL, *res = NULL;
    int rc_cu, rc_nc;

    if (nargs != 2)
        return PyErr_Format(PyExc_TypeError,
                            "cuda_status() takes 2 arguments (cudart, nccl)");
    if (ss_py_cands_from(args[0], "cuda_status", "cudart", &cu_c) < 0 ||
        ss_py_cands_from(args[1], "cuda_status", "nccl", &nc_c) < 0)
        goto out;
    /* Two reasons of 1 KiB each: keep them off the stack. */
    cs = PyMem_Malloc(sizeof *cs);
    ns = PyMem_Malloc(sizeof *ns);
    if (cs == NULL || ns == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    Py_BEGIN_ALLOW_THREADS
        rc_cu = ss_cuda_probe(cu_c.names, cu_c.n, cs);
        rc_nc = ss_nccl_probe(nc_c.names, nc_c.n, ns);
    Py_END_ALLOW_THREADS
    if (rc_cu < 0 && rc_cu != SS_ENOTAVAIL) {
        ss_errinfo info;
        ss_errinfo_clear(&info);
        ss_errinfo_set(&info, rc_cu, "load libcudart", NULL, -1, "%s",
                       cs->reason);
        ss_py_raise(st, rc_cu, &info);
        goto out;
    }
    if (rc_nc < 0 && rc_nc != SS_ENOTAVAIL) {
        ss_errinfo info;
        ss_errinfo_clear(&info);
        ss_errinfo_set(&info, rc_nc, "load libnccl", NULL, -1, "%s",
                       ns->reason);
        ss_py_raise(st, rc_nc, &info);
        goto out;
    }
    cu_d = status_dict(
        "{sNsNsisisisisNsN}", "loaded", PyBool_FromLong(cs->loaded),
        "available", PyBool_FromLong(cs->available), "runtime_version",
        cs->runtime_version, "driver_version", cs->driver_version,
        "device_count", cs->device_count, "device_error", cs->device_error,
        "path",
        cs->path[0] ? PyUnicode_DecodeFSDefault(cs->path) : Py_NewRef(Py_None),
        "reason",
        PyUnicode_DecodeUTF8(cs->reason, (Py_ssize_t)strlen(cs->reason),
                             "replace"));
    if (cu_d == NULL)
        goto out;
    nc_d = status_dict(
        "{sNsisNsN}", "loaded", PyBool_FromLong(ns->loaded), "version",
        ns->version, "path",
        ns->path[0] ? PyUnicode_DecodeFSDefault(ns->path) : Py_NewRef(Py_None),
        "reason",
        PyUnicode_DecodeUTF8(ns->reason, (Py_ssize_t)strlen(ns->reason),
                             "replace"));
    if (nc_d == NULL)
        goto out;
    res = Py_BuildValue("{sOsO}", "cuda", cu_d, "nccl", nc_d);
out:
    Py_XDECREF(cu_d);
    Py_XDECREF(nc_d);
    PyMem_Free(cs);
    PyMem_Free(ns);
    ss_py_cands_release(&cu_c);
    ss_py_cands_release(&nc_c);
    return res;
}

static PyMethodDef cuda_methods[] = {
    {"cuda_status", (PyCFunction)(void (*)(void))py_cuda_status, METH_FASTCALL,
     "cuda_status(cudart, nccl, /)\n--\n\n"
     "Load libcudart and libnccl (each from the first usable candidate "
     "name or path, or the default sonames for None; loaded once per file "
     "and kept) and count CUDA devices. Returns {'cuda': {loaded, available, "
     "runtime_version, driver_version, device_count, device_error, path, "
     "reason}, 'nccl': {loaded, version, path, reason}}. A missing or "
     "refused library is reported, not raised."},
    {NULL, NULL, 0, NULL},
};

int ss_py_cuda_init(PyObject *m, ss_state *st)
{
    (void)st;
    return PyModule_AddFunctions(m, cuda_methods);
}
