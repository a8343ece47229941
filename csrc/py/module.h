/* module.h - module state and the helpers shared by the csrc/py files.
 *
 * csrc/py is the only place that includes Python.h or NumPy. Each concern
 * has one file that adds its functions and types to the module from its
 * ss_py_<concern>_init(); module.c calls them from the exec slot.
 * There are no static PyObject* globals: everything lives in ss_state.
 */
#ifndef SS_PY_MODULE_H
#define SS_PY_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "ss_error.h"
#include "ss_pool.h"

typedef struct {
    PyObject *Error;         /* shardstate.ShardstateError(Exception) */
    PyObject *IOError;       /* ShardstateIOError(ShardstateError, OSError) */
    PyObject *ChecksumError; /* ChecksumError(ShardstateError) */
    PyTypeObject *ThreadPool_type;
    PyTypeObject *GeomIndex_type;
    PyTypeObject *FaultInjector_type;
    PyTypeObject *MappedFile_type;
    PyTypeObject *FlatLayout_type;
    PyTypeObject *Stage_type;
    PyTypeObject *NcclComm_type;
    PyTypeObject *RecordPlan_type;
    PyTypeObject *MemSink_type;
} ss_state;

extern PyModuleDef ss_module_def;

static inline ss_state *ss_get_state(PyObject *module)
{
    return (ss_state *)PyModule_GetState(module);
}

/* State from an instance of one of our heap types. */
static inline ss_state *ss_state_from_type(PyTypeObject *tp)
{
    PyObject *m = PyType_GetModuleByDef(tp, &ss_module_def);
    return m == NULL ? NULL : ss_get_state(m);
}

/* The one translation point from a core error code to a Python exception.
 * info may be NULL. Always returns NULL, so callers can
 * `return ss_py_raise(st, rc, &info);`. */
PyObject *ss_py_raise(ss_state *st, int rc, const ss_errinfo *info);

/* A new tuple of the n int64 values v[0..n) as ints, or NULL with an
 * exception set. */
PyObject *ss_py_int_tuple(const int64_t *v, size_t n);

/* obj is None or a ThreadPool: store its ss_pool* (NULL for None) in *out.
 * Returns 0, or -1 with TypeError set. */
int ss_py_pool_arg(ss_state *st, PyObject *obj, ss_pool **out);

/* obj is None or a Stage: store its ss_stage* (NULL for None) in *out and
 * whether its backend is CUDA in *cuda. */
struct ss_stage;
int ss_py_stage_arg(ss_state *st, PyObject *obj, struct ss_stage **out,
                    int *cuda);

/* A device buffer from obj.__cuda_array_interface__: C-contiguous (and
 * writable, if asked), its pointer and length in bytes; what names it in
 * errors ("buffers[3]"). 0, or -1 with TypeError / ValueError /
 * BufferError set. */
int ss_py_cai_buffer(PyObject *obj, const char *what, int writable, void **ptr,
                     Py_ssize_t *len);

/* A CUDA stream: None (the default stream, NULL) or an int handle such as
 * torch.cuda.current_stream().cuda_stream. 0, or -1 with an error set. */
int ss_py_stream_arg(PyObject *obj, void **out);

/* obj is a RecordPlan: its ss_zip_plan in *out. 0, or -1 with TypeError
 * set. */
struct ss_zip_plan;
int ss_py_zip_plan_arg(ss_state *st, PyObject *obj,
                       const struct ss_zip_plan **out);

/* obj is None, a FaultInjector or a MemSink: its vtable in *out (NULL for
 * None). 0, or -1 with TypeError set. */
struct ss_os;
int ss_py_faults_arg(ss_state *st, PyObject *obj, const struct ss_os **out);
/* obj is a MemSink (recmem.c): its vtable in *out, returns 1; else 0. */
int ss_py_memsink_os(ss_state *st, PyObject *obj, const struct ss_os **out);

/* Library candidates: obj is None (the core's default names) or a
 * non-empty sequence of str / bytes / os.PathLike paths; func and argname
 * name the argument in errors. keep holds the bytes objects, names points
 * into them; release with ss_py_cands_release. 0 or -1 with an error set. */
typedef struct {
    PyObject *keep;     /* list of bytes, or NULL for None */
    const char **names; /* NULL for None */
    size_t n;
} ss_py_cands;
int ss_py_cands_from(PyObject *obj, const char *func, const char *argname,
                     ss_py_cands *c);
void ss_py_cands_release(ss_py_cands *c);

/* Load libcudart from the cudart candidates and, when nc is not NULL,
 * libnccl from the nccl ones (GIL released). 0, or -1 with the loader's
 * reason raised (ShardstateError). */
struct ss_cuda;
struct ss_nccl;
int ss_py_load_libs(ss_state *st, const char *func, PyObject *cudart,
                    PyObject *nccl, const struct ss_cuda **cu,
                    const struct ss_nccl **nc);

/* Per-concern initialisers, called by the exec slot in this order. */
int ss_py_errors_init(PyObject *m, ss_state *st);
int ss_py_pool_init(PyObject *m, ss_state *st);
int ss_py_crc_init(PyObject *m, ss_state *st);
int ss_py_faults_init(PyObject *m, ss_state *st);
int ss_py_io_init(PyObject *m, ss_state *st);
int ss_py_file_init(PyObject *m, ss_state *st);
int ss_py_geom_init(PyObject *m, ss_state *st);
int ss_py_flat_init(PyObject *m, ss_state *st);
int ss_py_stage_init(PyObject *m, ss_state *st);
int ss_py_comm_init(PyObject *m, ss_state *st);
int ss_py_cuda_init(PyObject *m, ss_state *st);
int ss_py_pickle_init(PyObject *m, ss_state *st);
int ss_py_mdwrite_init(PyObject *m, ss_state *st);
int ss_py_mdread_init(PyObject *m, ss_state *st);
int ss_py_plan_init(PyObject *m, ss_state *st);
int ss_py_zipwrite_init(PyObject *m, ss_state *st);
int ss_py_zipread_init(PyObject *m, ss_state *st);
int ss_py_safetensors_init(PyObject *m, ss_state *st);
int ss_py_recmem_init(PyObject *m, ss_state *st);

#endif /* SS_PY_MODULE_H */
