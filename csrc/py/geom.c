/* geom.c - the GeomIndex type and copy_region(): chunk geometry for Python.
 *
 * GeomIndex(offsets, sizes) wraps an immutable ss_geom_index, so queries run
 * with the GIL released and need no lock; it holds no PyObject, so it needs
 * no traverse/clear. copy_region() moves a sub-box between two NumPy arrays
 * through ss_copy_nd, GIL released, after checking every bound here: the
 * core never sees an offset outside an array.
 */
#include "module.h"
#include "ss_geom.h"
#include "ss_numpy.h"

#include <string.h>

typedef struct {
    PyObject_HEAD
    ss_geom_index *ix;
    unsigned long long last_visited;
} GeomIndexObject;

/* obj as a C-contiguous aligned int64 array, or NULL. Any integer dtype
 * is accepted (values out of int64 range fail validation later, as
 * negative); floats and bools are refused rather than truncated. */
static PyArrayObject *as_int64(PyObject *obj, const char *fn)
{
    PyArrayObject *a, *r = NULL;
    PyArray_Descr *d;

    a = (PyArrayObject *)PyArray_FromAny(obj, NULL, 0, 0, 0, NULL);
    if (a == NULL)
        return NULL;
    if (!PyArray_ISINTEGER(a) && PyArray_SIZE(a) != 0) {
        PyErr_Format(PyExc_TypeError,
                     "%s: offsets and sizes must be integers, got dtype %S", fn,
                     (PyObject *)PyArray_DESCR(a));
        goto out;
    }
    d = PyArray_DescrFromType(NPY_INT64);
    if (d == NULL)
        goto out;
    /* PyArray_FromArray steals d. */
    r = (PyArrayObject *)PyArray_FromArray(
        a, d, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
out:
    Py_DECREF(a);
    return r;
}

/* Convert an (offsets, sizes) pair that must both have want_nd dims of the
 * same shape; last_dim >= 0 also fixes their last dimension. */
static int box_arrays(PyObject *o, PyObject *s, int want_nd, npy_intp last_dim,
                      const char *fn, PyArrayObject **ao, PyArrayObject **as)
{
    *as = NULL;
    *ao = as_int64(o, fn);
    if (*ao == NULL)
        goto fail;
    *as = as_int64(s, fn);
    if (*as == NULL)
        goto fail;
    if (PyArray_NDIM(*ao) != want_nd || PyArray_NDIM(*as) != want_nd) {
        PyErr_Format(PyExc_ValueError,
                     "%s: offsets and sizes must be %d-d arrays%s, got %d-d "
                     "and %d-d",
                     fn, want_nd, want_nd == 2 ? " of shape (n, ndim)" : "",
                     PyArray_NDIM(*ao), PyArray_NDIM(*as));
        goto fail;
    }
    if (!PyArray_SAMESHAPE(*ao, *as)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: offsets and sizes have different shapes", fn);
        goto fail;
    }
    if (last_dim >= 0 && PyArray_DIM(*ao, want_nd - 1) != last_dim) {
        PyErr_Format(PyExc_ValueError,
                     "%s: boxes have %zd dims but the index has %zd", fn,
                     (Py_ssize_t)PyArray_DIM(*ao, want_nd - 1),
                     (Py_ssize_t)last_dim);
        goto fail;
    }
    if (PyArray_DIM(*ao, want_nd - 1) > SS_GEOM_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "%s: more than %d dims", fn,
                     SS_GEOM_MAX_NDIM);
        goto fail;
    }
    return 0;
fail:
    Py_CLEAR(*ao);
    Py_CLEAR(*as);
    return -1;
}

static PyObject *GeomIndex_new(PyTypeObject *type, PyObject *args,
                               PyObject *kwds)
{
    static char *kwlist[] = {"offsets", "sizes", NULL};
    PyObject *o, *s, *ret = NULL;
    PyArrayObject *ao = NULL, *as = NULL;
    ss_geom_index *ix = NULL;
    ss_errinfo info;
    GeomIndexObject *self;
    int rc;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:GeomIndex", kwlist, &o,
                                     &s))
        return NULL;
    if (box_arrays(o, s, 2, -1, "GeomIndex", &ao, &as) < 0)
        goto out;
    ss_errinfo_clear(&info);
    Py_BEGIN_ALLOW_THREADS
        rc = ss_geom_index_new(&ix, (int)PyArray_DIM(ao, 1),
                               (size_t)PyArray_DIM(ao, 0),
                               (const int64_t *)PyArray_DATA(ao),
                               (const int64_t *)PyArray_DATA(as), &info);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        ss_py_raise(ss_state_from_type(type), rc, &info);
        goto out;
    }
    self = (GeomIndexObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        goto out;
    self->ix = ix;
    ix = NULL;
    ret = (PyObject *)self;
out:
    ss_geom_index_free(ix);
    Py_XDECREF(ao);
    Py_XDECREF(as);
    return ret;
}

static void GeomIndex_dealloc(GeomIndexObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    ss_geom_index_free(self->ix);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* A new int64 array of rows x cols (cols < 0: 1-d) holding data. */
static PyObject *i64_array(const int64_t *data, size_t rows, int cols)
{
    npy_intp dims[2] = {(npy_intp)rows, cols < 0 ? 0 : cols};
    PyObject *a = PyArray_SimpleNew(cols < 0 ? 1 : 2, dims, NPY_INT64);
    size_t n = rows * (size_t)(cols < 0 ? 1 : cols);
    if (a != NULL && n > 0)
        memcpy(PyArray_DATA((PyArrayObject *)a), data, n * sizeof *data);
    return a;
}

/* Shared by query and query_many: m requests with m_nd-dim arrays. */
static PyObject *query_common(GeomIndexObject *self, PyObject *const *args,
                              Py_ssize_t nargs, int many)
{
    const char *fn = many ? "GeomIndex.query_many" : "GeomIndex.query";
    int nd = ss_geom_index_ndim(self->ix), rc;
    PyArrayObject *ao = NULL, *as = NULL;
    PyObject *ret = NULL, *cols[5] = {NULL};
    ss_overlaps o;
    ss_errinfo info;
    size_t m;

    ss_overlaps_init(&o);
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError,
                     "%s() takes 2 arguments (offsets, "
                     "sizes)",
                     fn);
        goto out;
    }
    if (box_arrays(args[0], args[1], many ? 2 : 1, nd, fn, &ao, &as) < 0)
        goto out;
    m = many ? (size_t)PyArray_DIM(ao, 0) : 1;
    ss_errinfo_clear(&info);
    Py_BEGIN_ALLOW_THREADS
        rc = ss_geom_query_many(self->ix, m, (const int64_t *)PyArray_DATA(ao),
                                (const int64_t *)PyArray_DATA(as), &o, &info);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        ss_py_raise(ss_state_from_type(Py_TYPE(self)), rc, &info);
        goto out;
    }
    self->last_visited = o.visited;
    cols[0] = i64_array(o.request_index, o.count, -1);
    cols[1] = i64_array(o.saved_index, o.count, -1);
    cols[2] = i64_array(o.saved_offset, o.count, nd);
    cols[3] = i64_array(o.request_offset, o.count, nd);
    cols[4] = i64_array(o.lengths, o.count, nd);
    if (!cols[0] || !cols[1] || !cols[2] || !cols[3] || !cols[4])
        goto out;
    ret = many ? PyTuple_Pack(5, cols[0], cols[1], cols[2], cols[3], cols[4])
               : PyTuple_Pack(4, cols[1], cols[2], cols[3], cols[4]);
out:
    for (int i = 0; i < 5; i++)
        Py_XDECREF(cols[i]);
    ss_overlaps_destroy(&o);
    Py_XDECREF(ao);
    Py_XDECREF(as);
    return ret;
}

static PyObject *GeomIndex_query(GeomIndexObject *self, PyObject *const *args,
                                 Py_ssize_t nargs)
{
    return query_common(self, args, nargs, 0);
}

static PyObject *GeomIndex_query_many(GeomIndexObject *self,
                                      PyObject *const *args, Py_ssize_t nargs)
{
    return query_common(self, args, nargs, 1);
}

static Py_ssize_t GeomIndex_len(GeomIndexObject *self)
{
    return (Py_ssize_t)ss_geom_index_count(self->ix);
}

static PyObject *GeomIndex_get_ndim(GeomIndexObject *self, void *c)
{
    (void)c;
    return PyLong_FromLong(ss_geom_index_ndim(self->ix));
}

static PyObject *GeomIndex_get_visited(GeomIndexObject *self, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong(self->last_visited);
}

static PyObject *GeomIndex_repr(GeomIndexObject *self)
{
    return PyUnicode_FromFormat("<shardstate GeomIndex boxes=%zd ndim=%d>",
                                (Py_ssize_t)ss_geom_index_count(self->ix),
                                ss_geom_index_ndim(self->ix));
}

static PyMethodDef GeomIndex_methods[] = {
    {"query", (PyCFunction)(void (*)(void))GeomIndex_query, METH_FASTCALL,
     "query(offsets, sizes)\n--\n\n"
     "Overlaps of the saved boxes with one requested box (two length-ndim "
     "int arrays), as a tuple of int64 arrays (saved_index[k], "
     "saved_offset[k, ndim], request_offset[k, ndim], lengths[k, ndim]) "
     "sorted by saved index. Offsets are relative to the saved box and to "
     "the request. Empty boxes overlap nothing; with ndim 0 every saved "
     "box overlaps."},
    {"query_many", (PyCFunction)(void (*)(void))GeomIndex_query_many,
     METH_FASTCALL,
     "query_many(offsets, sizes)\n--\n\n"
     "query() for m requests given as (m, ndim) arrays; returns "
     "(request_index[k], saved_index, saved_offset, request_offset, "
     "lengths) sorted by (request_index, saved_index)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef GeomIndex_getset[] = {
    {"ndim", (getter)GeomIndex_get_ndim, NULL, "Dimensions of every box.",
     NULL},
    {"last_visited", (getter)GeomIndex_get_visited, NULL,
     "Tree nodes plus boxes examined by the last query on this object (a "
     "cost measure for tests; not synchronised between threads).",
     NULL},
    {NULL},
};

static PyType_Slot GeomIndex_slots[] = {
    {Py_tp_new, GeomIndex_new},
    {Py_tp_dealloc, GeomIndex_dealloc},
    {Py_tp_repr, GeomIndex_repr},
    {Py_tp_methods, GeomIndex_methods},
    {Py_tp_getset, GeomIndex_getset},
    {Py_sq_length, GeomIndex_len},
    {Py_tp_doc, "GeomIndex(offsets, sizes)\n--\n\n"
                "A spatial index over n saved boxes, given as two (n, ndim) "
                "int64 arrays (offsets >= 0, sizes >= 0). Immutable; "
                "queries release the GIL."},
    {0, NULL},
};

static PyType_Spec GeomIndex_spec = {
    .name = "shardstate._core.GeomIndex",
    .basicsize = sizeof(GeomIndexObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = GeomIndex_slots,
};

/* ---- copy_region -------------------------------------------------------- */

/* obj, a sequence of n ints, into out. -1 with an exception on error. */
static int int64_vec(PyObject *obj, int n, const char *name, int64_t *out)
{
    PyObject *seq = PySequence_Fast(obj, "");
    int rc = -1;

    if (seq == NULL) {
        PyErr_Format(PyExc_TypeError,
                     "copy_region: %s must be a sequence of %d ints", name, n);
        goto out;
    }
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError,
                     "copy_region: %s has %zd entries, the arrays have %d "
                     "dims",
                     name, PySequence_Fast_GET_SIZE(seq), n);
        goto out;
    }
    for (int d = 0; d < n; d++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, d));
        if (v == -1 && PyErr_Occurred())
            goto out;
        out[d] = v;
    }
    rc = 0;
out:
    Py_XDECREF(seq);
    return rc;
}

/* Check off + len fits in arr along every dim; d names the dim. */
static int check_bounds(PyArrayObject *arr, const int64_t *off,
                        const int64_t *len, int nd, const char *name)
{
    for (int d = 0; d < nd; d++) {
        int64_t dim = (int64_t)PyArray_DIM(arr, d);
        if (len[d] < 0) {
            PyErr_Format(PyExc_ValueError,
                         "copy_region: dim %d: negative length %lld", d,
                         (long long)len[d]);
            return -1;
        }
        if (off[d] < 0 || off[d] > dim || len[d] > dim - off[d]) {
            PyErr_Format(PyExc_ValueError,
                         "copy_region: dim %d: %s offset %lld + length %lld "
                         "outside %s shape %lld",
                         d, name, (long long)off[d], (long long)len[d], name,
                         (long long)dim);
            return -1;
        }
    }
    return 0;
}

static int plain_array(PyObject *obj, const char *name)
{
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "copy_region: %s must be a numpy.ndarray, got %.200s",
                     name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyDataType_REFCHK(PyArray_DESCR((PyArrayObject *)obj))) {
        PyErr_Format(PyExc_TypeError,
                     "copy_region: %s holds Python objects; only plain data "
                     "can be copied",
                     name);
        return -1;
    }
    return 0;
}

static PyObject *py_copy_region(PyObject *m, PyObject *const *args,
                                Py_ssize_t nargs)
{
    ss_state *st = ss_get_state(m);
    PyArrayObject *dst, *src;
    int64_t doff[SS_GEOM_MAX_NDIM], soff[SS_GEOM_MAX_NDIM];
    int64_t len[SS_GEOM_MAX_NDIM], dstr[SS_GEOM_MAX_NDIM],
        sstr[SS_GEOM_MAX_NDIM];
    ss_pool *pool = NULL;
    ss_errinfo info;
    char *dp;
    const char *sp;
    int nd, rc;
    size_t elsize;

    if (nargs != 5 && nargs != 6)
        return PyErr_Format(PyExc_TypeError,
                            "copy_region() takes 5 or 6 arguments (dst, "
                            "dst_offset, src, src_offset, lengths[, pool])");
    if (plain_array(args[0], "dst") < 0 || plain_array(args[2], "src") < 0)
        return NULL;
    dst = (PyArrayObject *)args[0];
    src = (PyArrayObject *)args[2];
    if (PyArray_FailUnlessWriteable(dst, "copy_region dst") < 0)
        return NULL;
    elsize = (size_t)PyArray_ITEMSIZE(dst);
    if ((size_t)PyArray_ITEMSIZE(src) != elsize)
        return PyErr_Format(PyExc_TypeError,
                            "copy_region: dst items are %zd bytes, src items "
                            "%zd",
                            (Py_ssize_t)elsize,
                            (Py_ssize_t)PyArray_ITEMSIZE(src));
    nd = PyArray_NDIM(dst);
    if (PyArray_NDIM(src) != nd)
        return PyErr_Format(PyExc_ValueError,
                            "copy_region: dst has %d dims, src %d", nd,
                            PyArray_NDIM(src));
    if (int64_vec(args[1], nd, "dst_offset", doff) < 0 ||
        int64_vec(args[3], nd, "src_offset", soff) < 0 ||
        int64_vec(args[4], nd, "lengths", len) < 0)
        return NULL;
    if (check_bounds(dst, doff, len, nd, "dst") < 0 ||
        check_bounds(src, soff, len, nd, "src") < 0)
        return NULL;
    if (ss_py_pool_arg(st, nargs == 6 ? args[5] : Py_None, &pool) < 0)
        return NULL;
    dp = PyArray_BYTES(dst);
    sp = PyArray_BYTES(src);
    for (int d = 0; d < nd; d++) {
        dstr[d] = (int64_t)PyArray_STRIDE(dst, d);
        sstr[d] = (int64_t)PyArray_STRIDE(src, d);
        /* In bounds, so these point at (or, for length 0, next to) real
         * elements; a zero-length copy never dereferences them. */
        if (len[d] > 0) {
            dp += doff[d] * dstr[d];
            sp += soff[d] * sstr[d];
        }
    }
    ss_errinfo_clear(&info);
    Py_BEGIN_ALLOW_THREADS
        rc = ss_copy_nd(pool, dp, dstr, sp, sstr, len, nd, elsize, &info);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return ss_py_raise(st, rc, &info);
    Py_RETURN_NONE;
}

/* One row of chunk_boxes: getattr(chunk, name) as nd int64s in dst.
 * 0, 1 when it does not hold nd values, or -1 with an error set. */
static int chunk_row(PyObject *chunk, PyObject *name, Py_ssize_t nd,
                     int64_t *dst)
{
    PyObject *v, *seq = NULL, **items;
    int rc = -1;

    v = PyObject_GetAttr(chunk, name);
    if (v == NULL)
        return -1;
    /* torch.Size is a tuple subclass: read in place, without a copy. */
    if (PyTuple_Check(v)) {
        seq = Py_NewRef(v);
    } else {
        seq = PySequence_Fast(v, "chunk_boxes: offsets and sizes must be "
                                 "sequences of ints");
        if (seq == NULL)
            goto out;
    }
    if (PySequence_Fast_GET_SIZE(seq) != nd) {
        rc = 1;
        goto out;
    }
    items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < nd; i++) {
        long long x = PyLong_AsLongLong(items[i]);
        if (x == -1 && PyErr_Occurred())
            goto out;
        dst[i] = (int64_t)x;
    }
    rc = 0;
out:
    Py_XDECREF(seq);
    Py_DECREF(v);
    return rc;
}

/* chunk_boxes(chunks, ndim): the boxes of DCP chunks (objects with
 * .offsets and .sizes) as two (n, ndim) int64 arrays, or None when some
 * chunk has another number of dims. A planner reads every saved chunk of a
 * tensor this way: one attribute lookup per box side, no Python loop. */
static PyObject *py_chunk_boxes(PyObject *module, PyObject *const *args,
                                Py_ssize_t nargs)
{
    PyObject *seq = NULL, *names[2] = {NULL, NULL}, *res = NULL;
    PyArrayObject *arr[2] = {NULL, NULL};
    Py_ssize_t n, nd;
    npy_intp dims[2];
    (void)module;

    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError,
                        "chunk_boxes(chunks, ndim) takes 2 arguments");
        return NULL;
    }
    nd = PyLong_AsSsize_t(args[1]);
    if (nd == -1 && PyErr_Occurred())
        return NULL;
    if (nd < 0 || nd > SS_GEOM_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError,
                     "chunk_boxes: ndim must be in [0, %d], got %zd",
                     SS_GEOM_MAX_NDIM, nd);
        return NULL;
    }
    seq = PySequence_Fast(args[0], "chunk_boxes: chunks must be a sequence");
    if (seq == NULL)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    dims[0] = (npy_intp)n;
    dims[1] = (npy_intp)nd;
    names[0] = PyUnicode_InternFromString("offsets");
    names[1] = PyUnicode_InternFromString("sizes");
    if (names[0] == NULL || names[1] == NULL)
        goto out;
    for (int k = 0; k < 2; k++) {
        arr[k] = (PyArrayObject *)PyArray_SimpleNew(2, dims, NPY_INT64);
        if (arr[k] == NULL)
            goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *chunk = PySequence_Fast_GET_ITEM(seq, i);
        for (int k = 0; k < 2; k++) {
            int r = chunk_row(chunk, names[k], nd,
                              (int64_t *)PyArray_DATA(arr[k]) + i * nd);
            if (r < 0)
                goto out;
            if (r > 0) {
                res = Py_NewRef(Py_None);
                goto out;
            }
        }
    }
    res = PyTuple_Pack(2, (PyObject *)arr[0], (PyObject *)arr[1]);
out:
    Py_XDECREF(arr[0]);
    Py_XDECREF(arr[1]);
    Py_XDECREF(names[0]);
    Py_XDECREF(names[1]);
    Py_DECREF(seq);
    return res;
}

static PyMethodDef geom_methods[] = {
    {"chunk_boxes", (PyCFunction)(void (*)(void))py_chunk_boxes, METH_FASTCALL,
     "chunk_boxes(chunks, ndim)\n"
     "--\n\n"
     "(offsets, sizes): the .offsets and .sizes of each chunk (e.g. DCP's "
     "ChunkStorageMetadata) as two (len(chunks), ndim) int64 arrays, or "
     "None when some chunk has another number of dims. OverflowError for "
     "values outside int64, TypeError for values that are not integers."},
    {"copy_region", (PyCFunction)(void (*)(void))py_copy_region, METH_FASTCALL,
     "copy_region(dst, dst_offset, src, src_offset, lengths, pool=None)\n"
     "--\n\n"
     "dst[dst_offset:dst_offset+lengths] = src[src_offset:"
     "src_offset+lengths] for two NumPy arrays of the same ndim and "
     "itemsize (bytes are copied, dtypes are not compared or cast). Any "
     "strides, negative included; bounds are checked per dim. Refuses "
     "read-only dst, object dtypes, and src/dst whose memory ranges "
     "intersect (ShardstateError). The GIL is released; copies over 1 MiB "
     "are split over pool's threads."},
    {NULL, NULL, 0, NULL},
};

int ss_py_geom_init(PyObject *m, ss_state *st)
{
    st->GeomIndex_type =
        (PyTypeObject *)PyType_FromModuleAndSpec(m, &GeomIndex_spec, NULL);
    if (st->GeomIndex_type == NULL)
        return -1;
    if (PyModule_AddType(m, st->GeomIndex_type) < 0)
        return -1;
    return PyModule_AddFunctions(m, geom_methods);
}
