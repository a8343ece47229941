/* module.c - shardstate._core: PEP 489 multi-phase init and module state. */
#define SS_IMPORT_NUMPY
#include "module.h"
#include "ss_numpy.h"

PyObject *ss_py_int_tuple(const int64_t *v, size_t n)
{
    PyObject *t = PyTuple_New((Py_ssize_t)n);
    for (size_t i = 0; t != NULL && i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (x == NULL) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, x);
    }
    return t;
}

static int ss_exec(PyObject *m)
{
    ss_state *st = ss_get_state(m);

    if (PyArray_ImportNumPyAPI() < 0)
        return -1;
    if (ss_py_errors_init(m, st) < 0 || ss_py_pool_init(m, st) < 0 ||
        ss_py_crc_init(m, st) < 0 || ss_py_faults_init(m, st) < 0 ||
        ss_py_io_init(m, st) < 0 || ss_py_file_init(m, st) < 0 ||
        ss_py_geom_init(m, st) < 0 || ss_py_flat_init(m, st) < 0 ||
        ss_py_stage_init(m, st) < 0 || ss_py_cuda_init(m, st) < 0 ||
        ss_py_comm_init(m, st) < 0 || ss_py_pickle_init(m, st) < 0 ||
        ss_py_mdwrite_init(m, st) < 0 || ss_py_mdread_init(m, st) < 0 ||
        ss_py_plan_init(m, st) < 0 || ss_py_zipwrite_init(m, st) < 0 ||
        ss_py_zipread_init(m, st) < 0 || ss_py_safetensors_init(m, st) < 0 ||
        ss_py_recmem_init(m, st) < 0)
        return -1;
    return 0;
}

static int ss_traverse(PyObject *m, visitproc visit, void *arg)
{
    ss_state *st = ss_get_state(m);
    Py_VISIT(st->Error);
    Py_VISIT(st->IOError);
    Py_VISIT(st->ChecksumError);
    Py_VISIT(st->ThreadPool_type);
    Py_VISIT(st->GeomIndex_type);
    Py_VISIT(st->FaultInjector_type);
    Py_VISIT(st->MappedFile_type);
    Py_VISIT(st->FlatLayout_type);
    Py_VISIT(st->Stage_type);
    Py_VISIT(st->NcclComm_type);
    Py_VISIT(st->RecordPlan_type);
    Py_VISIT(st->MemSink_type);
    return 0;
}

static int ss_clear(PyObject *m)
{
    ss_state *st = ss_get_state(m);
    Py_CLEAR(st->Error);
    Py_CLEAR(st->IOError);
    Py_CLEAR(st->ChecksumError);
    Py_CLEAR(st->ThreadPool_type);
    Py_CLEAR(st->GeomIndex_type);
    Py_CLEAR(st->FaultInjector_type);
    Py_CLEAR(st->MappedFile_type);
    Py_CLEAR(st->FlatLayout_type);
    Py_CLEAR(st->Stage_type);
    Py_CLEAR(st->NcclComm_type);
    Py_CLEAR(st->RecordPlan_type);
    Py_CLEAR(st->MemSink_type);
    return 0;
}

static void ss_free(void *m)
{
    (void)ss_clear((PyObject *)m);
}

static PyModuleDef_Slot ss_slots[] = {
    {Py_mod_exec, ss_exec},
    {0, NULL},
};

PyModuleDef ss_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shardstate._core",
    .m_doc = "shardstate's C core: checksums, parallel file I/O, chunk "
             "geometry, FSDP flat parameters.",
    .m_size = sizeof(ss_state),
    .m_slots = ss_slots,
    .m_traverse = ss_traverse,
    .m_clear = ss_clear,
    .m_free = ss_free,
};

PyMODINIT_FUNC PyInit__core(void)
{
    return PyModuleDef_Init(&ss_module_def);
}
