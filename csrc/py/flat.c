/* flat.c - the FlatLayout type and flat_copy(): FSDP flat parameters.
 *
 * FlatLayout(numels, world_size, align_numel) wraps an immutable
 * ss_flat_layout (no PyObject inside, so no traverse/clear); its getters
 * build tuples on demand. flat_copy() takes a whole batch of (layout, rank,
 * shard, pieces, pad) jobs, holds a C-contiguous view of every buffer and a
 * reference to every layout for the whole call, checks every size here
 * (each piece's element count comes from its buffer's length), and runs
 * ss_flat_flatten / ss_flat_unflatten with the GIL released.
 */
#include "module.h"
#include "ss_flat.h"

#include <string.h>

typedef struct {
    PyObject_HEAD
    ss_flat_layout *l;
} FlatLayoutObject;

static int64_t index_arg(PyObject *o, const char *what, int *ok)
{
    PyObject *ix = PyNumber_Index(o);
    long long v;
    *ok = 0;
    if (ix == NULL)
        return -1;
    v = PyLong_AsLongLong(ix);
    Py_DECREF(ix);
    if (v == -1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s does not fit in int64", what);
        }
        return -1;
    }
    *ok = 1;
    return (int64_t)v;
}

static PyObject *FlatLayout_new(PyTypeObject *type, PyObject *args,
                                PyObject *kwds)
{
    static char *kwlist[] = {"numels", "world_size", "align_numel", NULL};
    PyObject *nobj, *seq = NULL, *ret = NULL;
    long long ws, align;
    int64_t *numels = NULL;
    ss_flat_layout *l = NULL;
    ss_errinfo info;
    Py_ssize_t n;
    int rc, ok;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OLL:FlatLayout", kwlist,
                                     &nobj, &ws, &align))
        return NULL;
    seq = PySequence_Tuple(nobj);
    if (seq == NULL) {
        PyErr_Clear();
        return PyErr_Format(PyExc_TypeError,
                            "FlatLayout: numels must be a sequence of ints");
    }
    n = PyTuple_GET_SIZE(seq);
    numels = PyMem_Malloc(((size_t)n + 1) * sizeof *numels);
    if (numels == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        numels[i] = index_arg(PyTuple_GET_ITEM(seq, i), "a numel", &ok);
        if (!ok)
            goto out;
    }
    ss_errinfo_clear(&info);
    rc = ss_flat_layout_new(&l, (size_t)n, numels, ws, align, &info);
    if (rc < 0) {
        ss_py_raise(ss_state_from_type(type), rc, &info);
        goto out;
    }
    {
        FlatLayoutObject *self = (FlatLayoutObject *)type->tp_alloc(type, 0);
        if (self == NULL)
            goto out;
        self->l = l;
        l = NULL;
        ret = (PyObject *)self;
    }
out:
    ss_flat_layout_free(l);
    PyMem_Free(numels);
    Py_DECREF(seq);
    return ret;
}

static void FlatLayout_dealloc(FlatLayoutObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    ss_flat_layout_free(self->l);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

#define SS__GET_INT(name, fn)                                                  \
    static PyObject *FlatLayout_get_##name(FlatLayoutObject *self, void *c)    \
    {                                                                          \
        (void)c;                                                               \
        return PyLong_FromLongLong(fn(self->l));                               \
    }
SS__GET_INT(world_size, ss_flat_world_size)
SS__GET_INT(align_numel, ss_flat_align_numel)
SS__GET_INT(unpadded_numel, ss_flat_unpadded_numel)
SS__GET_INT(flat_numel, ss_flat_flat_numel)
SS__GET_INT(shard_numel, ss_flat_shard_numel)
SS__GET_INT(padded_numel, ss_flat_padded_numel)
#undef SS__GET_INT

static PyObject *FlatLayout_get_numels(FlatLayoutObject *self, void *c)
{
    (void)c;
    return ss_py_int_tuple(ss_flat_numels(self->l), ss_flat_nparams(self->l));
}

static PyObject *FlatLayout_get_offsets(FlatLayoutObject *self, void *c)
{
    (void)c;
    return ss_py_int_tuple(ss_flat_offsets(self->l), ss_flat_nparams(self->l));
}

static PyObject *FlatLayout_get_numels_with_padding(FlatLayoutObject *self,
                                                    void *c)
{
    (void)c;
    return ss_py_int_tuple(ss_flat_segment_numels(self->l),
                           ss_flat_nsegments(self->l));
}

static PyObject *FlatLayout_get_is_padding_mask(FlatLayoutObject *self, void *c)
{
    size_t n = ss_flat_nsegments(self->l);
    const unsigned char *m = ss_flat_segment_is_padding(self->l);
    PyObject *t = PyTuple_New((Py_ssize_t)n);
    (void)c;
    for (size_t i = 0; t != NULL && i < n; i++)
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, PyBool_FromLong(m[i]));
    return t;
}

/* Tuple of (in_shard, offset_in_shard, numel_in_shard, intra_start,
 * intra_end) tuples, None for the numbers of a parameter not in the shard. */
static PyObject *infos_tuple(const ss_flat_info *f, size_t n)
{
    PyObject *t = PyTuple_New((Py_ssize_t)n);
    for (size_t i = 0; t != NULL && i < n; i++) {
        PyObject *row;
        if (f[i].in_shard)
            row = Py_BuildValue(
                "(OLLLL)", Py_True, (long long)f[i].offset_in_shard,
                (long long)f[i].numel_in_shard, (long long)f[i].intra_start,
                (long long)f[i].intra_end);
        else
            row = PyTuple_Pack(5, Py_False, Py_None, Py_None, Py_None, Py_None);
        if (row == NULL) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, row);
    }
    return t;
}

static PyObject *infos_common(FlatLayoutObject *self, int ranged,
                              PyObject *const *args, Py_ssize_t nargs)
{
    size_t n = ss_flat_nparams(self->l);
    ss_flat_info *f;
    ss_errinfo info;
    PyObject *ret = NULL;
    int64_t a, b = 0;
    int rc, ok;

    if (nargs != (ranged ? 2 : 1))
        return PyErr_Format(PyExc_TypeError, "%s",
                            ranged ? "range_infos() takes 2 arguments "
                                     "(start, end)"
                                   : "shard_infos() takes 1 argument (rank)");
    a = index_arg(args[0], ranged ? "start" : "rank", &ok);
    if (!ok)
        return NULL;
    if (ranged) {
        b = index_arg(args[1], "end", &ok);
        if (!ok)
            return NULL;
    }
    f = PyMem_Malloc(n * sizeof *f);
    if (f == NULL)
        return PyErr_NoMemory();
    ss_errinfo_clear(&info);
    rc = ranged ? ss_flat_range_infos(self->l, a, b, f, &info)
                : ss_flat_shard_infos(self->l, a, f, &info);
    if (rc < 0)
        ss_py_raise(ss_state_from_type(Py_TYPE(self)), rc, &info);
    else
        ret = infos_tuple(f, n);
    PyMem_Free(f);
    return ret;
}

static PyObject *FlatLayout_shard_infos(FlatLayoutObject *self,
                                        PyObject *const *args, Py_ssize_t nargs)
{
    return infos_common(self, 0, args, nargs);
}

static PyObject *FlatLayout_range_infos(FlatLayoutObject *self,
                                        PyObject *const *args, Py_ssize_t nargs)
{
    return infos_common(self, 1, args, nargs);
}

static PyObject *FlatLayout_shard_range(FlatLayoutObject *self, PyObject *arg)
{
    int64_t r, s, e;
    ss_errinfo info;
    int rc, ok;

    r = index_arg(arg, "rank", &ok);
    if (!ok)
        return NULL;
    ss_errinfo_clear(&info);
    rc = ss_flat_shard_range(self->l, r, &s, &e, &info);
    if (rc < 0)
        return ss_py_raise(ss_state_from_type(Py_TYPE(self)), rc, &info);
    return Py_BuildValue("(LL)", (long long)s, (long long)e);
}

static PyObject *FlatLayout_repr(FlatLayoutObject *self)
{
    return PyUnicode_FromFormat(
        "<shardstate FlatLayout params=%zd world_size=%lld align_numel=%lld "
        "padded_numel=%lld>",
        (Py_ssize_t)ss_flat_nparams(self->l),
        (long long)ss_flat_world_size(self->l),
        (long long)ss_flat_align_numel(self->l),
        (long long)ss_flat_padded_numel(self->l));
}

static PyMethodDef FlatLayout_methods[] = {
    {"shard_range", (PyCFunction)FlatLayout_shard_range, METH_O,
     "shard_range(rank, /)\n--\n\n"
     "rank's [start, end) in the padded flat parameter."},
    {"shard_infos", (PyCFunction)(void (*)(void))FlatLayout_shard_infos,
     METH_FASTCALL,
     "shard_infos(rank, /)\n--\n\n"
     "Per parameter, torch's _ShardParamInfo fields for rank's shard as a "
     "tuple (in_shard, offset_in_shard, numel_in_shard, "
     "intra_param_start_idx, intra_param_end_idx); the numbers are None "
     "when not in the shard."},
    {"range_infos", (PyCFunction)(void (*)(void))FlatLayout_range_infos,
     METH_FASTCALL,
     "range_infos(start, end, /)\n--\n\n"
     "shard_infos() for any range [start, end) of the padded flat "
     "parameter (torch's _get_shard_metadata(start, end - 1))."},
    {NULL, NULL, 0, NULL},
};

#define SS__GS(name, doc)                                                      \
    {#name, (getter)FlatLayout_get_##name, NULL, doc, NULL}
static PyGetSetDef FlatLayout_getset[] = {
    SS__GS(world_size, "Number of ranks."),
    SS__GS(align_numel, "Alignment in elements (0: none)."),
    SS__GS(numels, "Numel of each real parameter."),
    SS__GS(offsets, "Start of each real parameter in the flat parameter."),
    SS__GS(unpadded_numel, "End of the last parameter."),
    SS__GS(flat_numel, "Parameters and alignment/world-size padding: "
                       "torch's _unpadded_unsharded_size."),
    SS__GS(shard_numel, "Elements in each rank's shard, padding included."),
    SS__GS(padded_numel, "shard_numel * world_size."),
    SS__GS(numels_with_padding, "torch's _numels_with_padding."),
    SS__GS(is_padding_mask, "torch's _is_padding_mask."),
    {NULL},
};
#undef SS__GS

static PyType_Slot FlatLayout_slots[] = {
    {Py_tp_new, FlatLayout_new},
    {Py_tp_dealloc, FlatLayout_dealloc},
    {Py_tp_repr, FlatLayout_repr},
    {Py_tp_methods, FlatLayout_methods},
    {Py_tp_getset, FlatLayout_getset},
    {Py_tp_doc, "FlatLayout(numels, world_size, align_numel)\n--\n\n"
                "The FSDP1 flat-parameter layout of one unit (torch 2.13's "
                "FlatParamHandle): parameters in order with alignment "
                "padding when align_numel > 0, sharded over world_size "
                "ranks as torch.chunk does. Immutable."},
    {0, NULL},
};

static PyType_Spec FlatLayout_spec = {
    .name = "shardstate._core.FlatLayout",
    .basicsize = sizeof(FlatLayoutObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = FlatLayout_slots,
};

/* ---- flat_copy ---------------------------------------------------------- */

typedef struct {
    Py_ssize_t njobs, nviews, nlayouts;
    ss_flat_job *jobs;
    ss_flat_piece *pieces; /* all jobs' pieces, back to back */
    Py_buffer *views;
    PyObject **layouts; /* strong references */
} copy_args;

static void copy_release(copy_args *a)
{
    for (Py_ssize_t i = 0; a->views != NULL && i < a->nviews; i++)
        PyBuffer_Release(&a->views[i]);
    for (Py_ssize_t i = 0; a->layouts != NULL && i < a->nlayouts; i++)
        Py_DECREF(a->layouts[i]);
    PyMem_Free(a->jobs);
    PyMem_Free(a->pieces);
    PyMem_Free(a->views);
    PyMem_Free(a->layouts);
}

/* A C-contiguous view of obj in the next slot; -1 with an exception. */
static Py_buffer *take_view(copy_args *a, PyObject *obj, int writable,
                            Py_ssize_t j, const char *what)
{
    Py_buffer *v = &a->views[a->nviews];
    int flags =
        PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "flat_copy: job %zd: %s must support the buffer "
                     "protocol, not %.200s",
                     j, what, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    if (PyObject_GetBuffer(obj, v, flags) < 0) {
        PyErr_Clear(); /* exporters differ: BufferError, ValueError */
        PyErr_Format(PyExc_ValueError,
                     "flat_copy: job %zd: %s must be a C-contiguous%s "
                     "buffer",
                     j, what, writable ? ", writable" : "");
        return NULL;
    }
    a->nviews++;
    return v;
}

/* Convert job j, a (layout, rank, shard, pieces, pad) tuple. */
static int get_job(ss_state *st, copy_args *a, PyObject *item, Py_ssize_t j,
                   int unflatten, ss_flat_piece **next_piece)
{
    PyObject *pseq = NULL;
    ss_flat_job *job = &a->jobs[j];
    const ss_flat_layout *l;
    Py_buffer *v;
    Py_ssize_t np;
    int64_t rank;
    int rc = -1, ok;

    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 5) {
        PyErr_Format(PyExc_TypeError,
                     "flat_copy: job %zd must be a (layout, rank, shard, "
                     "pieces, pad) tuple",
                     j);
        return -1;
    }
    if (!PyObject_TypeCheck(PyTuple_GET_ITEM(item, 0), st->FlatLayout_type)) {
        PyErr_Format(PyExc_TypeError,
                     "flat_copy: job %zd: layout must be a FlatLayout", j);
        return -1;
    }
    a->layouts[a->nlayouts++] = Py_NewRef(PyTuple_GET_ITEM(item, 0));
    l = ((FlatLayoutObject *)PyTuple_GET_ITEM(item, 0))->l;
    rank = index_arg(PyTuple_GET_ITEM(item, 1), "rank", &ok);
    if (!ok)
        return -1;
    if (rank < 0 || rank >= ss_flat_world_size(l)) {
        PyErr_Format(PyExc_ValueError,
                     "flat_copy: job %zd: rank %lld outside [0, %lld)", j,
                     (long long)rank, (long long)ss_flat_world_size(l));
        return -1;
    }
    if ((v = take_view(a, PyTuple_GET_ITEM(item, 2), !unflatten, j, "shard")) ==
        NULL)
        return -1;
    if (v->itemsize < 1 || v->itemsize > SS_FLAT_MAX_ITEMSIZE ||
        v->len != ss_flat_shard_numel(l) * v->itemsize) {
        PyErr_Format(PyExc_ValueError,
                     "flat_copy: job %zd: shard has %zd bytes of %zd-byte "
                     "items, the layout's shard is %lld elements",
                     j, v->len, v->itemsize, (long long)ss_flat_shard_numel(l));
        return -1;
    }
    *job =
        (ss_flat_job){l, rank, (size_t)v->itemsize, v->buf, *next_piece, NULL};
    pseq = PySequence_Tuple(PyTuple_GET_ITEM(item, 3));
    if (pseq == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "flat_copy: job %zd: pieces must be a sequence", j);
        goto out;
    }
    np = PyTuple_GET_SIZE(pseq);
    if ((size_t)np != ss_flat_nparams(l)) {
        PyErr_Format(PyExc_ValueError,
                     "flat_copy: job %zd: %zd pieces for %zd parameters", j, np,
                     (Py_ssize_t)ss_flat_nparams(l));
        goto out;
    }
    for (Py_ssize_t i = 0; i < np; i++) {
        PyObject *p = PyTuple_GET_ITEM(pseq, i);
        ss_flat_piece *pc = (*next_piece)++;
        Py_buffer *pv;
        *pc = (ss_flat_piece){NULL, 0, 0};
        if (p == Py_None)
            continue;
        if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) != 2) {
            PyErr_Format(PyExc_TypeError,
                         "flat_copy: job %zd: piece %zd must be None or a "
                         "(buffer, start) tuple",
                         j, i);
            goto out;
        }
        if ((pv = take_view(a, PyTuple_GET_ITEM(p, 0), unflatten, j,
                            "a piece")) == NULL)
            goto out;
        if (pv->itemsize != v->itemsize) {
            PyErr_Format(PyExc_ValueError,
                         "flat_copy: job %zd: piece %zd has %zd-byte items, "
                         "the shard %zd-byte",
                         j, i, pv->itemsize, v->itemsize);
            goto out;
        }
        pc->data = pv->buf;
        pc->numel = pv->len / pv->itemsize;
        pc->start = index_arg(PyTuple_GET_ITEM(p, 1), "start", &ok);
        if (!ok)
            goto out;
        if (pc->start < 0 || pc->start > ss_flat_numels(l)[i] ||
            pc->numel > ss_flat_numels(l)[i] - pc->start) {
            PyErr_Format(PyExc_ValueError,
                         "flat_copy: job %zd: piece %zd holds elements "
                         "[%lld, %lld) of a parameter of %lld",
                         j, i, (long long)pc->start,
                         (long long)pc->start + (long long)pc->numel,
                         (long long)ss_flat_numels(l)[i]);
            goto out;
        }
    }
    if (PyTuple_GET_ITEM(item, 4) != Py_None) {
        if ((v = take_view(a, PyTuple_GET_ITEM(item, 4), 0, j, "pad")) == NULL)
            goto out;
        if ((size_t)v->len != job->itemsize) {
            PyErr_Format(PyExc_ValueError,
                         "flat_copy: job %zd: pad has %zd bytes, items are "
                         "%zu",
                         j, v->len, job->itemsize);
            goto out;
        }
        job->pad = v->buf;
    }
    rc = 0;
out:
    Py_XDECREF(pseq);
    return rc;
}

static PyObject *py_flat_copy(PyObject *m, PyObject *const *args,
                              Py_ssize_t nargs)
{
    ss_state *st = ss_get_state(m);
    copy_args a = {0};
    PyObject *seq = NULL, *ret = NULL;
    ss_flat_piece *next;
    ss_pool *pool = NULL;
    ss_errinfo info;
    size_t npieces = 0;
    int unflatten, rc;

    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError,
                            "flat_copy() takes 3 arguments (jobs, unflatten, "
                            "pool)");
    if ((unflatten = PyObject_IsTrue(args[1])) < 0 ||
        ss_py_pool_arg(st, args[2], &pool) < 0)
        return NULL;
    seq = PySequence_Tuple(args[0]); /* fixed while __index__ code runs */
    if (seq == NULL)
        return NULL;
    a.njobs = PyTuple_GET_SIZE(seq);
    for (Py_ssize_t j = 0; j < a.njobs; j++) { /* size the piece table */
        PyObject *item = PyTuple_GET_ITEM(seq, j);
        if (PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 5 &&
            PyObject_TypeCheck(PyTuple_GET_ITEM(item, 0), st->FlatLayout_type))
            npieces += ss_flat_nparams(
                ((FlatLayoutObject *)PyTuple_GET_ITEM(item, 0))->l);
    }
    a.jobs = PyMem_Calloc((size_t)a.njobs + 1, sizeof *a.jobs);
    a.pieces = PyMem_Calloc(npieces + 1, sizeof *a.pieces);
    a.views = PyMem_Calloc(2 * (size_t)a.njobs + npieces + 1, sizeof *a.views);
    a.layouts = PyMem_Calloc((size_t)a.njobs + 1, sizeof *a.layouts);
    if (!a.jobs || !a.pieces || !a.views || !a.layouts) {
        PyErr_NoMemory();
        goto out;
    }
    next = a.pieces;
    for (Py_ssize_t j = 0; j < a.njobs; j++)
        if (get_job(st, &a, PyTuple_GET_ITEM(seq, j), j, unflatten, &next) < 0)
            goto out;
    ss_errinfo_clear(&info);
    Py_BEGIN_ALLOW_THREADS
        rc = unflatten ? ss_flat_unflatten(pool, a.jobs, (size_t)a.njobs, &info)
                       : ss_flat_flatten(pool, a.jobs, (size_t)a.njobs, &info);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        ss_py_raise(st, rc, &info);
        goto out;
    }
    ret = Py_NewRef(Py_None);
out:
    copy_release(&a);
    Py_DECREF(seq);
    return ret;
}

static PyMethodDef flat_methods[] = {
    {"flat_copy", (PyCFunction)(void (*)(void))py_flat_copy, METH_FASTCALL,
     "flat_copy(jobs, unflatten, pool, /)\n--\n\n"
     "Copy between per-parameter buffers and ranks' flat shards for a batch "
     "of jobs, each a (layout, rank, shard, pieces, pad) tuple: pieces has "
     "one entry per parameter, None or (buffer, start) with the buffer "
     "holding the parameter's flattened elements [start, start + len). "
     "unflatten false: write each whole shard (None pieces as zeros, "
     "padding as pad's element, or zeros for pad None). unflatten true: "
     "copy each shard's parameter ranges into the pieces that hold them. "
     "Buffers must be C-contiguous (written ones writable) with equal item "
     "sizes; destinations may not overlap each other or a source. The GIL "
     "is released; big batches use pool's threads."},
    {NULL, NULL, 0, NULL},
};

int ss_py_flat_init(PyObject *m, ss_state *st)
{
    st->FlatLayout_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(m, &FlatLayout_spec, NULL);
    if (st->FlatLayout_type == NULL)
        return -1;
    if (PyModule_AddType(m, st->FlatLayout_type) < 0)
        return -1;
    return PyModule_AddFunctions(m, flat_methods);
}
