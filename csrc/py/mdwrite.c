/* mdwrite.c - md_dumps(): the .metadata writer's fast path
 * (python/shardstate/checkpoint/_pickle/writer.py, _dumps_c).
 *
 * It walks a Metadata graph (shardstate's classes or torch's) as
 * writer._Convert.fast does, and writes through ss_pkwrite the bytes
 * CPython's pickler writes for the stand-in graph that conversion builds
 * (pickle.dumps(root, protocol=4)), opcode for opcode: the same save()
 * entries (frame boundaries), the same memo entries, keyed by the same
 * object identities. Objects the conversion makes anew (state dicts, sizes
 * made from tuples, their argument tuples) take a memo entry and no key.
 *
 * Whatever the fast conversion would hand over to the generic one, and
 * anything else outside the walk below (sets, ints past 64 bits, objects
 * outside the metadata classes, sizes, dtypes, layouts and paths, cycles
 * through tuples, strings with lone surrogates), makes it decline: it
 * returns None and the Python writer runs. Python calls: __getstate__ of
 * TensorProperties (and of a _StorageInfo whose __getstate__ is not the
 * known one), writer._Convert.props_state, __reduce_ex__ of dtypes, layouts
 * and paths; an exception from one of them also declines.
 *
 * Memo entries hold a reference to their key until the call ends, as the
 * pickler's memo does, so no address is reused meanwhile. A value whose
 * only reference is the slot it is read from (its reference count, less
 * the walk's own) cannot be met again: it takes a memo entry but no key,
 * and is not looked up, which keeps the table to the shared objects (dict
 * keys are always looked up: split-table dicts share key objects). The GIL is
 * held throughout: the walk reads Python objects at every step. Thread-safe.
 */
#include "module.h"
#include "ss_pkwrite.h"

enum { K_MD, K_TSM, K_TP, K_CSM, K_BSM, K_MI, K_SM, K_SI, K_N };
enum { USED_MD = 1, USED_FS = 2, USED_SIZE = 4 };

/* Attribute and key names, interned once per call. */
#define NAME_LIST(X)                                                           \
    X(S_DICT, "__dict__")                                                      \
    X(S_GETSTATE, "__getstate__")                                              \
    X(S_MODULE, "__module__")                                                  \
    X(S_QUALNAME, "__qualname__")                                              \
    X(S_NAME, "__name__")                                                      \
    X(S_TD, "transform_descriptors")                                           \
    X(S_OFFSETS, "offsets")                                                    \
    X(S_SIZES, "sizes")                                                        \
    X(S_FQN, "fqn")                                                            \
    X(S_INDEX, "index")                                                        \
    X(S_OFFSET, "offset")                                                      \
    X(S_RPATH, "relative_path")                                                \
    X(S_LENGTH, "length")
#define NAME_ENUM(id, text) id,
enum { NAME_LIST(NAME_ENUM) N_NAMES };
#undef NAME_ENUM
#define CONV 0x80000000u /* a memo value's flag: a converted source object */
#define PLAIN_DEPTH 100  /* writer._PLAIN_DEPTH */

typedef struct {
    ss_pkw w;
    ss_pkmemo memo;
    int decline;
    unsigned used;
    PyObject *ok[K_N];   /* tuples of the types accepted for each class */
    PyObject *cls[K_N];  /* the stand-in classes written */
    PyObject *size_cls;  /* torch.Size, or the placeholder Size */
    PyObject *native;    /* types the plain values may hold as they are */
    PyObject *reducible; /* types written through their reduce value */
    PyObject *purepath;
    PyObject *props_cb; /* _Convert.props_state */
    PyObject *gs_known; /* __getstate__ functions dropping None values */
    PyObject *dispatch; /* copyreg.dispatch_table */
    int torch;
    PyObject *names[N_NAMES]; /* interned, see NAME_LIST */
} mdw;

static int decline(mdw *s)
{
    s->decline = 1;
    return -1;
}

/* A core call's code as this file's: 0, or -1 (the writer holds why). */
static int wr(int rc)
{
    return rc < 0 ? -1 : 0;
}

static int type_in(PyObject *tuple, PyTypeObject *t)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); i++)
        if (PyTuple_GET_ITEM(tuple, i) == (PyObject *)t)
            return 1;
    return 0;
}

static int is_atom(PyObject *v)
{
    PyTypeObject *t = Py_TYPE(v);
    return v == Py_None || t == &PyBool_Type || t == &PyLong_Type ||
           t == &PyFloat_Type || t == &PyUnicode_Type || t == &PyBytes_Type;
}

/* d[name] (borrowed) or NULL; d is an exact dict, names are strings. */
static PyObject *item(mdw *s, PyObject *d, int name)
{
    return PyDict_GetItemWithError(d, s->names[name]); /* hash cached */
}

static int str_eq(PyObject *k, const char *lit)
{
    return PyUnicode_CheckExact(k) &&
           PyUnicode_CompareWithASCIIString(k, lit) == 0;
}

/* MEMOIZE, recording key (NULL: a new object no one else can reach). */
static int memo_put(mdw *s, PyObject *key, int conv)
{
    uint32_t idx;
    if (ss_pkw_memoize(&s->w, &idx) < 0)
        return -1;
    if (idx >= CONV)
        return decline(s);
    if (key == NULL)
        return 0;
    if (ss_pkmemo_put(&s->memo, (uintptr_t)key, idx | (conv ? CONV : 0))) {
        PyErr_NoMemory();
        return -1;
    }
    Py_INCREF(key);
    return 0;
}

/* 1 (and *idx) when key was memoized, else 0. */
static int memo_has(mdw *s, PyObject *key, uint32_t *val)
{
    return ss_pkmemo_get(&s->memo, (uintptr_t)key, val);
}

/* A source object the conversion rebuilds: written already (BINGET, 1),
 * new (0), or shared with a plain value (decline, -1). */
static int conv_get(mdw *s, PyObject *key)
{
    uint32_t v;
    if (!memo_has(s, key, &v))
        return 0;
    if (!(v & CONV))
        return decline(s);
    return wr(ss_pkw_get(&s->w, v & ~CONV)) < 0 ? -1 : 1;
}

static int int_of(mdw *s, PyObject *v, int64_t *out)
{
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow)
        return decline(s);
    if (x == -1 && PyErr_Occurred())
        return -1;
    *out = (int64_t)x;
    return 0;
}

static int save(mdw *s, PyObject *v, int depth, int uniq);

static int save_str(mdw *s, PyObject *v, int uniq)
{
    Py_ssize_t n;
    const char *p = PyUnicode_AsUTF8AndSize(v, &n);
    if (p == NULL) { /* lone surrogates: the pickler's surrogatepass */
        PyErr_Clear();
        return decline(s);
    }
    if (ss_pkw_str(&s->w, p, (size_t)n) < 0)
        return -1;
    return memo_put(s, uniq ? NULL : v, 0);
}

/* The batching of batch_dict_exact (dict: 1) and batch_list_exact (0):
 * n == 1 is one SETITEM / APPEND; else MARK ... SETITEMS / APPENDS per
 * SS_PKW_BATCH items, a dict of a multiple of it ending in an empty batch. */
typedef struct {
    Py_ssize_t n, done, in;
    int dict;
} batch;

static int batch_open(mdw *s, batch *b, Py_ssize_t n, int dict)
{
    b->n = n;
    b->done = b->in = 0;
    b->dict = dict;
    return n >= 2 ? wr(ss_pkw_op(&s->w, SS_PK_MARK)) : 0;
}

static int batch_item(mdw *s, batch *b)
{
    ss_pkw *w = &s->w;
    b->done++;
    if (b->n == 1)
        return wr(ss_pkw_op(w, b->dict ? SS_PK_SETITEM : SS_PK_APPEND));
    if (++b->in < SS_PKW_BATCH)
        return 0;
    b->in = 0;
    if (ss_pkw_op(w, b->dict ? SS_PK_SETITEMS : SS_PK_APPENDS) < 0)
        return -1;
    if (b->dict || b->done < b->n)
        return wr(ss_pkw_op(w, SS_PK_MARK));
    return 0;
}

static int batch_close(mdw *s, batch *b)
{
    if (b->done != b->n)
        return decline(s); /* changed size meanwhile */
    if (b->n < 2 || (!b->dict && b->in == 0))
        return 0;
    return wr(ss_pkw_op(&s->w, b->dict ? SS_PK_SETITEMS : SS_PK_APPENDS));
}

static int save_dict(mdw *s, PyObject *d, int depth, int uniq)
{
    batch b;
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    if (ss_pkw_op(&s->w, SS_PK_EMPTY_DICT) < 0 ||
        memo_put(s, uniq ? NULL : d, 0) < 0 ||
        batch_open(s, &b, PyDict_GET_SIZE(d), 1) < 0)
        return -1;
    while (b.done < b.n && PyDict_Next(d, &pos, &k, &v)) {
        int rc;
        Py_INCREF(k);
        Py_INCREF(v);
        rc = save(s, k, depth + 1, 0) < 0 ||
             save(s, v, depth + 1, Py_REFCNT(v) == 2) < 0 ||
             batch_item(s, &b) < 0;
        Py_DECREF(k);
        Py_DECREF(v);
        if (rc)
            return -1;
    }
    return batch_close(s, &b);
}

static int save_list(mdw *s, PyObject *l, int depth, int uniq)
{
    batch b;
    if (ss_pkw_op(&s->w, SS_PK_EMPTY_LIST) < 0 ||
        memo_put(s, uniq ? NULL : l, 0) < 0 ||
        batch_open(s, &b, PyList_GET_SIZE(l), 0) < 0)
        return -1;
    while (b.done < b.n && b.done < PyList_GET_SIZE(l)) {
        PyObject *v = PyList_GET_ITEM(l, b.done);
        int rc;
        Py_INCREF(v);
        rc = save(s, v, depth + 1, Py_REFCNT(v) == 2) < 0 ||
             batch_item(s, &b) < 0;
        Py_DECREF(v);
        if (rc)
            return -1;
    }
    return batch_close(s, &b);
}

static int save_tuple(mdw *s, PyObject *t, int depth, int uniq)
{
    static const unsigned char ops[4] = {SS_PK_EMPTY_TUPLE, SS_PK_TUPLE1,
                                         SS_PK_TUPLE2, SS_PK_TUPLE3};
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    uint32_t v;
    if (n == 0)
        return wr(ss_pkw_op(&s->w, SS_PK_EMPTY_TUPLE));
    if (n > 3 && ss_pkw_op(&s->w, SS_PK_MARK) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (save(s, PyTuple_GET_ITEM(t, i), depth + 1,
                 Py_REFCNT(PyTuple_GET_ITEM(t, i)) == 1) < 0)
            return -1;
    if (!uniq && memo_has(s, t, &v)) /* reached through itself */
        return decline(s);
    if (ss_pkw_op(&s->w, n > 3 ? SS_PK_TUPLE : ops[n]) < 0)
        return -1;
    return memo_put(s, uniq ? NULL : t, 0);
}

/* save_global: STACK_GLOBAL of obj.__module__ and name (or __qualname__),
 * both saved as the pickler saves them (memoized strings), then obj. */
static int save_global(mdw *s, PyObject *obj, PyObject *name)
{
    PyObject *q = NULL, *m = NULL;
    int rc = -1;
    if (name != NULL) {
        q = Py_NewRef(name);
    } else if ((q = PyObject_GetAttr(obj, s->names[S_QUALNAME])) == NULL) {
        PyErr_Clear();
        if ((q = PyObject_GetAttr(obj, s->names[S_NAME])) == NULL)
            goto out;
    }
    if ((m = PyObject_GetAttr(obj, s->names[S_MODULE])) == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            goto out;
        PyErr_Clear();
    }
    if (m == NULL || !PyUnicode_CheckExact(m) || !PyUnicode_CheckExact(q)) {
        rc = decline(s); /* whichmodule would search sys.modules */
        goto out;
    }
    if (save(s, m, 0, 0) < 0 || save(s, q, 0, 0) < 0 ||
        ss_pkw_op(&s->w, SS_PK_STACK_GLOBAL) < 0 || memo_put(s, obj, 0) < 0)
        goto out;
    rc = 0;
out:
    Py_XDECREF(q);
    Py_XDECREF(m);
    return rc;
}

/* save() of a class or function: BINGET, or save_global. */
static int save_class(mdw *s, PyObject *cls)
{
    uint32_t v;
    if (ss_pkw_boundary(&s->w) < 0)
        return -1;
    if (memo_has(s, cls, &v))
        return (v & CONV) ? decline(s) : wr(ss_pkw_get(&s->w, v));
    if (cls == (PyObject *)Py_TYPE(Py_None) ||
        cls == (PyObject *)Py_TYPE(Py_Ellipsis) ||
        cls == (PyObject *)Py_TYPE(Py_NotImplemented))
        return decline(s);
    return save_global(s, cls, NULL);
}

/* A torch.Size (or a tuple standing for one): REDUCE (Size, ((dims),)),
 * memoized under key (NULL: a size the conversion makes anew). The
 * caller has entered save(). */
static int save_size(mdw *s, PyObject *dims, PyObject *key)
{
    static const unsigned char ops[4] = {SS_PK_EMPTY_TUPLE, SS_PK_TUPLE1,
                                         SS_PK_TUPLE2, SS_PK_TUPLE3};
    ss_pkw *w = &s->w;
    Py_ssize_t n = PyTuple_GET_SIZE(dims);
    if (save_class(s, s->size_cls) < 0)
        return -1;
    ss_pkw_boundary(w); /* save(args) */
    ss_pkw_boundary(w); /* save(tuple(self)) */
    if (n > 3 && ss_pkw_op(w, SS_PK_MARK) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyTuple_GET_ITEM(dims, i);
        int64_t x;
        if (Py_TYPE(d) != &PyLong_Type)
            return decline(s);
        if (int_of(s, d, &x) < 0 || ss_pkw_boundary(w) < 0 ||
            ss_pkw_int(w, x) < 0)
            return -1;
    }
    if (n == 0) {
        if (ss_pkw_op(w, SS_PK_EMPTY_TUPLE) < 0)
            return -1;
    } else if (ss_pkw_op(w, n > 3 ? SS_PK_TUPLE : ops[n]) < 0 ||
               memo_put(s, NULL, 0) < 0) {
        return -1;
    }
    if (ss_pkw_op(w, SS_PK_TUPLE1) < 0 || memo_put(s, NULL, 0) < 0 ||
        ss_pkw_op(w, SS_PK_REDUCE) < 0)
        return -1;
    return memo_put(s, key, 0);
}

/* An object written through its reduce value (dtypes, layouts, memory
 * format encodings, paths): a name (save_global), or (callable, args). */
static int save_reduce(mdw *s, PyObject *v)
{
    PyObject *rf, *rv, *c, *a, *nm = NULL;
    uint32_t memo;
    int rc = -1;
    rf = PyDict_GetItemWithError(s->dispatch, (PyObject *)Py_TYPE(v));
    if (rf != NULL)
        rv = PyObject_CallOneArg(rf, v);
    else if (PyErr_Occurred())
        return -1;
    else
        rv = PyObject_CallMethod(v, "__reduce_ex__", "i", 4);
    if (rv == NULL) {
        PyErr_Clear();
        return decline(s);
    }
    if (PyUnicode_CheckExact(rv)) {
        rc = save_global(s, v, rv);
        goto out;
    }
    if (!PyTuple_CheckExact(rv) || PyTuple_GET_SIZE(rv) != 2) {
        rc = decline(s);
        goto out;
    }
    c = PyTuple_GET_ITEM(rv, 0);
    a = PyTuple_GET_ITEM(rv, 1);
    if (!PyTuple_CheckExact(a) || !(PyType_Check(c) || PyFunction_Check(c))) {
        rc = decline(s);
        goto out;
    }
    if ((nm = PyObject_GetAttr(c, s->names[S_NAME])) == NULL) {
        PyErr_Clear();
        rc = decline(s);
        goto out;
    }
    if (str_eq(nm, "__newobj__") || str_eq(nm, "__newobj_ex__")) {
        rc = decline(s);
        goto out;
    }
    if (PyObject_TypeCheck(v, (PyTypeObject *)s->purepath))
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(a); i++)
            if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(a, i))) {
                rc = decline(s); /* writer._path_ok */
                goto out;
            }
    if (save_class(s, c) < 0 || save(s, a, 0, 0) < 0 ||
        ss_pkw_op(&s->w, SS_PK_REDUCE) < 0)
        goto out;
    if (memo_has(s, v, &memo)) {
        rc = decline(s);
        goto out;
    }
    rc = memo_put(s, v, 0);
out:
    Py_XDECREF(nm);
    Py_DECREF(rv);
    return rc;
}

/* save(): a value the pickler writes as it is. Plain values follow
 * writer._Convert.check_plain: atoms, lists, dicts, tuples, torch's own
 * sizes, dtypes and layouts, str-part paths; no deeper than PLAIN_DEPTH;
 * nothing the conversion rebuilds. */
static int save(mdw *s, PyObject *v, int depth, int uniq)
{
    ss_pkw *w = &s->w;
    PyTypeObject *t = Py_TYPE(v);
    uint32_t memo;
    if (ss_pkw_boundary(w) < 0)
        return -1;
    if (v == Py_None)
        return wr(ss_pkw_op(w, SS_PK_NONE));
    if (v == Py_True || v == Py_False)
        return wr(ss_pkw_op(w, v == Py_True ? SS_PK_NEWTRUE : SS_PK_NEWFALSE));
    if (t == &PyLong_Type) {
        int64_t x;
        return int_of(s, v, &x) < 0 ? -1 : wr(ss_pkw_int(w, x));
    }
    if (t == &PyFloat_Type)
        return wr(ss_pkw_float(w, PyFloat_AS_DOUBLE(v)));
    if (t != &PyUnicode_Type && t != &PyBytes_Type && !type_in(s->native, t) &&
        depth > PLAIN_DEPTH)
        return decline(s);
    if (!uniq && memo_has(s, v, &memo))
        return (memo & CONV) ? decline(s) : wr(ss_pkw_get(w, memo));
    if (t == &PyUnicode_Type)
        return save_str(s, v, uniq);
    if (t == &PyBytes_Type) {
        if (ss_pkw_bytes(w, PyBytes_AS_STRING(v), (size_t)PyBytes_GET_SIZE(v)) <
            0)
            return -1;
        return memo_put(s, uniq ? NULL : v, 0);
    }
    if (t == &PyDict_Type)
        return save_dict(s, v, depth, uniq);
    if (t == &PyList_Type)
        return save_list(s, v, depth, uniq);
    if (t == &PyTuple_Type)
        return save_tuple(s, v, depth, uniq);
    if ((PyObject *)t == s->size_cls && type_in(s->native, t))
        return save_size(s, v, uniq ? NULL : v);
    if (type_in(s->reducible, t) ||
        PyObject_TypeCheck(v, (PyTypeObject *)s->purepath))
        return save_reduce(s, v);
    return decline(s);
}

/* ---- the metadata classes: NEWOBJ, then BUILD state ---- */

/* save(cls), save(()), NEWOBJ, memoized as the converted src. */
static int newobj(mdw *s, int k, PyObject *src)
{
    if (save_class(s, s->cls[k]) < 0 || ss_pkw_boundary(&s->w) < 0 ||
        ss_pkw_op(&s->w, SS_PK_EMPTY_TUPLE) < 0 ||
        ss_pkw_op(&s->w, SS_PK_NEWOBJ) < 0)
        return -1;
    s->used |= k == K_SI ? USED_FS : USED_MD;
    return memo_put(s, src, 1);
}

/* src.__dict__ as an exact dict (new reference), or NULL (declined). */
static PyObject *dict_of(mdw *s, PyObject *src)
{
    PyObject *d = PyObject_GetAttr(src, s->names[S_DICT]);
    if (d == NULL) {
        PyErr_Clear();
        decline(s);
        return NULL;
    }
    if (!PyDict_CheckExact(d)) {
        Py_DECREF(d);
        decline(s);
        return NULL;
    }
    return d;
}

/* A size field's value: torch's Size as it is (by identity), a tuple as a
 * new size; anything else declines (None where allow_none). */
static int save_size_field(mdw *s, PyObject *v, int allow_none, int uniq)
{
    if (Py_TYPE(v) == (PyTypeObject *)s->size_cls ||
        (allow_none && v == Py_None))
        return save(s, v, 0, uniq);
    if (!PyTuple_CheckExact(v))
        return decline(s);
    if (!s->torch)
        s->used |= USED_SIZE;
    if (ss_pkw_boundary(&s->w) < 0)
        return -1;
    return save_size(s, v, NULL);
}

/* _Convert.sizes: d rebuilt with its size fields made sizes (a new dict,
 * memoized under d as converted). fields: NULL-terminated names. */
static int save_sizes_dict(mdw *s, PyObject *d, const char *const *fields)
{
    batch b;
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    uint32_t memo;
    if (ss_pkw_boundary(&s->w) < 0)
        return -1;
    if (memo_has(s, d, &memo))
        return decline(s);
    if (ss_pkw_op(&s->w, SS_PK_EMPTY_DICT) < 0 || memo_put(s, d, 1) < 0 ||
        batch_open(s, &b, PyDict_GET_SIZE(d), 1) < 0)
        return -1;
    while (b.done < b.n && PyDict_Next(d, &pos, &k, &v)) {
        int field = 0, rc;
        for (const char *const *f = fields; *f; f++)
            field |= str_eq(k, *f);
        Py_INCREF(k);
        Py_INCREF(v);
        rc = save(s, k, 0, 0) < 0 ||
             (field ? save_size_field(s, v, str_eq(k, "offset"),
                                      Py_REFCNT(v) == 2)
                    : save(s, v, 0, Py_REFCNT(v) == 2)) < 0 ||
             batch_item(s, &b) < 0;
        Py_DECREF(k);
        Py_DECREF(v);
        if (rc)
            return -1;
    }
    return batch_close(s, &b);
}

/* A converted source object in a value position: BINGET, or write it.
 * uniq: the container's slot holds its only reference (the caller's
 * aside), so nothing reaches it again: no memo key. */
static int conv_value(mdw *s, PyObject *v, int uniq,
                      int (*write)(mdw *, PyObject *, int))
{
    int hit;
    if (ss_pkw_boundary(&s->w) < 0)
        return -1;
    if (uniq)
        return write(s, v, 1);
    hit = conv_get(s, v);
    if (hit != 0)
        return hit < 0 ? -1 : 0;
    return write(s, v, 0);
}

static int write_props(mdw *s, PyObject *p, int uniq)
{
    PyObject *st = NULL, *out = NULL;
    int rc = -1;
    if (!type_in(s->ok[K_TP], Py_TYPE(p)))
        return decline(s);
    st = PyObject_CallMethodObjArgs(p, s->names[S_GETSTATE], NULL);
    if (st == NULL || !PyTuple_CheckExact(st) || PyTuple_GET_SIZE(st) != 5)
        goto declined;
    out = PyObject_CallFunctionObjArgs(s->props_cb, st, Py_True, NULL);
    if (out == NULL || !PyTuple_CheckExact(out) || PyTuple_GET_SIZE(out) != 5)
        goto declined;
    if (newobj(s, K_TP, uniq ? NULL : p) < 0 ||
        save(s, out, 0, Py_REFCNT(out) == 1) < 0 ||
        ss_pkw_op(&s->w, SS_PK_BUILD) < 0)
        goto out;
    rc = 0;
    goto out;
declined:
    PyErr_Clear();
    rc = decline(s);
out:
    Py_XDECREF(st);
    Py_XDECREF(out);
    return rc;
}

static const char *const chunk_fields[] = {"offsets", "sizes", NULL};
static const char *const index_fields[] = {"offset", NULL};

static int write_chunk(mdw *s, PyObject *c, int uniq)
{
    PyObject *d, *off, *sz;
    int rc = -1;
    if (!type_in(s->ok[K_CSM], Py_TYPE(c)))
        return decline(s);
    if ((d = dict_of(s, c)) == NULL)
        return -1;
    off = item(s, d, S_OFFSETS);
    sz = item(s, d, S_SIZES);
    if (PyDict_GET_SIZE(d) != 2 || off == NULL || sz == NULL) {
        rc = decline(s);
        goto out;
    }
    if (newobj(s, K_CSM, uniq ? NULL : c) < 0)
        goto out;
    if (Py_TYPE(off) == (PyTypeObject *)s->size_cls &&
        Py_TYPE(sz) == (PyTypeObject *)s->size_cls) {
        /* the source's state dict, as it is (unique if only c holds it) */
        if (save(s, d, 0, uniq && Py_REFCNT(d) == 2) < 0)
            goto out;
    } else if (save_sizes_dict(s, d, chunk_fields) < 0) {
        goto out;
    }
    rc = wr(ss_pkw_op(&s->w, SS_PK_BUILD));
out:
    Py_DECREF(d);
    return rc;
}

static int write_chunks(mdw *s, PyObject *l, int uniq)
{
    batch b;
    if (!PyList_CheckExact(l))
        return decline(s);
    if (ss_pkw_op(&s->w, SS_PK_EMPTY_LIST) < 0 ||
        memo_put(s, uniq ? NULL : l, 1) < 0 ||
        batch_open(s, &b, PyList_GET_SIZE(l), 0) < 0)
        return -1;
    while (b.done < b.n && b.done < PyList_GET_SIZE(l)) {
        PyObject *c = PyList_GET_ITEM(l, b.done);
        int rc;
        Py_INCREF(c);
        rc = conv_value(s, c, Py_REFCNT(c) == 2, write_chunk) < 0;
        rc = rc || batch_item(s, &b) < 0;
        Py_DECREF(c);
        if (rc)
            return -1;
    }
    return batch_close(s, &b);
}

static int write_tsm(mdw *s, PyObject *e, int uniq)
{
    batch b;
    PyObject *d, *k, *v;
    Py_ssize_t pos = 0;
    int rc = -1;
    if ((d = dict_of(s, e)) == NULL)
        return -1;
    if (PyDict_GET_SIZE(d) == 0) {
        rc = decline(s);
        goto out;
    }
    if (newobj(s, K_TSM, uniq ? NULL : e) < 0 || ss_pkw_boundary(&s->w) < 0 ||
        ss_pkw_op(&s->w, SS_PK_EMPTY_DICT) < 0 || memo_put(s, NULL, 0) < 0 ||
        batch_open(s, &b, PyDict_GET_SIZE(d), 1) < 0)
        goto out;
    while (b.done < b.n && PyDict_Next(d, &pos, &k, &v)) {
        int r;
        Py_INCREF(k);
        Py_INCREF(v);
        if (!PyUnicode_CheckExact(k))
            r = decline(s);
        else if (save(s, k, 0, 0) < 0)
            r = -1;
        else if (str_eq(k, "properties"))
            r = conv_value(s, v, Py_REFCNT(v) == 2, write_props);
        else if (str_eq(k, "size"))
            r = save_size_field(s, v, 0, Py_REFCNT(v) == 2);
        else if (str_eq(k, "chunks"))
            r = conv_value(s, v, Py_REFCNT(v) == 2, write_chunks);
        else
            r = save(s, v, 0, Py_REFCNT(v) == 2);
        r = r < 0 || batch_item(s, &b) < 0;
        Py_DECREF(k);
        Py_DECREF(v);
        if (r)
            goto out;
    }
    if (batch_close(s, &b) < 0)
        goto out;
    rc = wr(ss_pkw_op(&s->w, SS_PK_BUILD));
out:
    Py_DECREF(d);
    return rc;
}

static int write_entry(mdw *s, PyObject *e, int uniq)
{
    if (type_in(s->ok[K_TSM], Py_TYPE(e)))
        return write_tsm(s, e, uniq);
    if (type_in(s->ok[K_BSM], Py_TYPE(e))) {
        PyObject *d = dict_of(s, e);
        Py_ssize_t n;
        if (d == NULL)
            return -1;
        n = PyDict_GET_SIZE(d);
        Py_DECREF(d);
        return n ? decline(s) : newobj(s, K_BSM, uniq ? NULL : e);
    }
    return decline(s);
}

static int write_entries(mdw *s, PyObject *sdm)
{
    batch b;
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    uint32_t memo;
    if (!PyDict_CheckExact(sdm) || memo_has(s, sdm, &memo))
        return decline(s);
    if (ss_pkw_op(&s->w, SS_PK_EMPTY_DICT) < 0 || memo_put(s, sdm, 1) < 0 ||
        batch_open(s, &b, PyDict_GET_SIZE(sdm), 1) < 0)
        return -1;
    while (b.done < b.n && PyDict_Next(sdm, &pos, &k, &v)) {
        int r;
        Py_INCREF(k);
        Py_INCREF(v);
        if (!PyUnicode_CheckExact(k))
            r = decline(s);
        else if (save(s, k, 0, 0) < 0 ||
                 conv_value(s, v, Py_REFCNT(v) == 2, write_entry) < 0 ||
                 batch_item(s, &b) < 0)
            r = -1;
        else
            r = 0;
        Py_DECREF(k);
        Py_DECREF(v);
        if (r < 0)
            return -1;
    }
    return batch_close(s, &b);
}

/* A MetadataIndex key: a new stand-in each time (keys are not shared). */
static int write_index(mdw *s, PyObject *idx)
{
    PyObject *d, *fqn, *index, *off;
    int rc = -1;
    if (!type_in(s->ok[K_MI], Py_TYPE(idx)))
        return decline(s);
    if ((d = dict_of(s, idx)) == NULL)
        return -1;
    fqn = item(s, d, S_FQN);
    index = item(s, d, S_INDEX);
    off = item(s, d, S_OFFSET);
    if (fqn == NULL || !PyUnicode_CheckExact(fqn) || index == NULL ||
        !is_atom(index) || PyDict_GET_SIZE(d) != (off == NULL ? 2 : 3) ||
        (off != NULL && Py_TYPE(off) != (PyTypeObject *)s->size_cls &&
         !PyTuple_CheckExact(off))) {
        rc = decline(s);
        goto out;
    }
    if (ss_pkw_boundary(&s->w) < 0 || newobj(s, K_MI, NULL) < 0)
        goto out;
    if (off == NULL || Py_TYPE(off) == (PyTypeObject *)s->size_cls) {
        if (save(s, d, 0, Py_REFCNT(d) == 2) < 0)
            goto out;
    } else if (save_sizes_dict(s, d, index_fields) < 0) {
        goto out;
    }
    rc = wr(ss_pkw_op(&s->w, SS_PK_BUILD));
out:
    Py_DECREF(d);
    return rc;
}

/* _StorageInfo's state: its __dict__ less a None transform_descriptors
 * (the usual case) or __getstate__'s, emulated for the known one (the
 * values that are not None) as a new dict; else the call's own dict. */
static int write_info(mdw *s, PyObject *info, int uniq)
{
    PyObject *d, *gs = NULL, *st = NULL, *k, *v, *td;
    Py_ssize_t pos = 0, n = 0;
    int rc = -1, skip_none = 0, copy = 0;
    batch b;
    if (!type_in(s->ok[K_SI], Py_TYPE(info)))
        return decline(s);
    if ((d = dict_of(s, info)) == NULL)
        return -1;
    td = item(s, d, S_TD);
    if (PyDict_GET_SIZE(d) == 4 && td == Py_None) {
        copy = 1;
        n = 3;
    } else {
        gs = PyObject_GetAttr((PyObject *)Py_TYPE(info), s->names[S_GETSTATE]);
        if (gs == NULL)
            goto declined;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(s->gs_known); i++)
            skip_none |= PyTuple_GET_ITEM(s->gs_known, i) == gs;
        if (skip_none) {
            while (PyDict_Next(d, &pos, &k, &v))
                n += v != Py_None;
        } else {
            st = PyObject_CallMethodObjArgs(info, s->names[S_GETSTATE], NULL);
            if (st == NULL || !PyDict_CheckExact(st))
                goto declined;
        }
    }
    {
        PyObject *src = st ? st : d;
        PyObject *rp = item(s, src, S_RPATH);
        PyObject *o = item(s, src, S_OFFSET);
        PyObject *ln = item(s, src, S_LENGTH);
        if (rp == NULL || !PyUnicode_CheckExact(rp) || o == NULL ||
            Py_TYPE(o) != &PyLong_Type || ln == NULL ||
            Py_TYPE(ln) != &PyLong_Type) {
            rc = decline(s);
            goto out;
        }
    }
    if (newobj(s, K_SI, uniq ? NULL : info) < 0)
        goto out;
    if (st != NULL) {
        if (save(s, st, 0, Py_REFCNT(st) == 1) < 0)
            goto out;
    } else {
        /* a new dict: its items from d (plain values past the first three
         * only for __getstate__'s, as the conversion checks them) */
        if (ss_pkw_boundary(&s->w) < 0 ||
            ss_pkw_op(&s->w, SS_PK_EMPTY_DICT) < 0 ||
            memo_put(s, NULL, 0) < 0 || batch_open(s, &b, n, 1) < 0)
            goto out;
        pos = 0;
        while (b.done < b.n && PyDict_Next(d, &pos, &k, &v)) {
            int r;
            if ((copy && str_eq(k, "transform_descriptors")) ||
                (skip_none && v == Py_None))
                continue;
            Py_INCREF(k);
            Py_INCREF(v);
            r = save(s, k, 1, 0) < 0 || save(s, v, 1, Py_REFCNT(v) == 2) < 0 ||
                batch_item(s, &b) < 0;
            Py_DECREF(k);
            Py_DECREF(v);
            if (r)
                goto out;
        }
        if (batch_close(s, &b) < 0)
            goto out;
    }
    rc = wr(ss_pkw_op(&s->w, SS_PK_BUILD));
    goto out;
declined:
    PyErr_Clear();
    rc = decline(s);
out:
    Py_DECREF(d);
    Py_XDECREF(gs);
    Py_XDECREF(st);
    return rc;
}

static int write_storage_data(mdw *s, PyObject *sd)
{
    batch b;
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    uint32_t memo;
    if (memo_has(s, sd, &memo))
        return decline(s);
    if (ss_pkw_op(&s->w, SS_PK_EMPTY_DICT) < 0 || memo_put(s, sd, 1) < 0 ||
        batch_open(s, &b, PyDict_GET_SIZE(sd), 1) < 0)
        return -1;
    while (b.done < b.n && PyDict_Next(sd, &pos, &k, &v)) {
        int r;
        Py_INCREF(k);
        Py_INCREF(v);
        r = write_index(s, k) < 0 ||
            conv_value(s, v, Py_REFCNT(v) == 2, write_info) < 0 ||
            batch_item(s, &b) < 0;
        Py_DECREF(k);
        Py_DECREF(v);
        if (r)
            return -1;
    }
    if (b.n)
        s->used |= USED_FS;
    return batch_close(s, &b);
}

static int write_storage_meta(mdw *s, PyObject *m)
{
    PyObject *d, *k, *v;
    Py_ssize_t pos = 0;
    uint32_t memo;
    batch b;
    int rc = -1;
    if (!type_in(s->ok[K_SM], Py_TYPE(m)) || memo_has(s, m, &memo))
        return decline(s);
    if ((d = dict_of(s, m)) == NULL)
        return -1;
    if (PyDict_GET_SIZE(d) == 0) {
        rc = decline(s);
        goto out;
    }
    if (newobj(s, K_SM, m) < 0 || ss_pkw_boundary(&s->w) < 0)
        goto out;
    if (memo_has(s, d, &memo)) {
        rc = (memo & CONV) ? decline(s) : wr(ss_pkw_get(&s->w, memo));
    } else {
        /* the source's dict, as it is; its values plain at depth 0 */
        if (ss_pkw_op(&s->w, SS_PK_EMPTY_DICT) < 0 || memo_put(s, d, 0) < 0 ||
            batch_open(s, &b, PyDict_GET_SIZE(d), 1) < 0)
            goto out;
        while (b.done < b.n && PyDict_Next(d, &pos, &k, &v)) {
            int r;
            Py_INCREF(k);
            Py_INCREF(v);
            r = save(s, k, 0, 0) < 0 || save(s, v, 0, Py_REFCNT(v) == 2) < 0 ||
                batch_item(s, &b) < 0;
            Py_DECREF(k);
            Py_DECREF(v);
            if (r)
                goto out;
        }
        rc = batch_close(s, &b);
    }
    if (rc == 0)
        rc = wr(ss_pkw_op(&s->w, SS_PK_BUILD));
out:
    Py_DECREF(d);
    return rc;
}

static int write_md(mdw *s, PyObject *md)
{
    batch b;
    PyObject *d, *k, *v;
    Py_ssize_t pos = 0;
    int rc = -1;
    if (!type_in(s->ok[K_MD], Py_TYPE(md)))
        return decline(s);
    if ((d = dict_of(s, md)) == NULL)
        return -1;
    if (PyDict_GET_SIZE(d) == 0) {
        rc = decline(s);
        goto out;
    }
    if (ss_pkw_boundary(&s->w) < 0 || newobj(s, K_MD, md) < 0 ||
        ss_pkw_boundary(&s->w) < 0 || ss_pkw_op(&s->w, SS_PK_EMPTY_DICT) < 0 ||
        memo_put(s, NULL, 0) < 0 ||
        batch_open(s, &b, PyDict_GET_SIZE(d), 1) < 0)
        goto out;
    while (b.done < b.n && PyDict_Next(d, &pos, &k, &v)) {
        int r;
        Py_INCREF(k);
        Py_INCREF(v);
        if (!PyUnicode_CheckExact(k))
            r = decline(s);
        else if (save(s, k, 0, 0) < 0)
            r = -1;
        else if (str_eq(k, "state_dict_metadata"))
            r = ss_pkw_boundary(&s->w) < 0 ? -1 : write_entries(s, v);
        else if (str_eq(k, "storage_data") && PyDict_CheckExact(v))
            r = ss_pkw_boundary(&s->w) < 0 ? -1 : write_storage_data(s, v);
        else if (str_eq(k, "storage_meta") && v != Py_None)
            r = ss_pkw_boundary(&s->w) < 0 ? -1 : write_storage_meta(s, v);
        else
            r = save(s, v, 0, Py_REFCNT(v) == 2);
        r = r < 0 || batch_item(s, &b) < 0;
        Py_DECREF(k);
        Py_DECREF(v);
        if (r)
            goto out;
    }
    if (batch_close(s, &b) < 0)
        goto out;
    rc = wr(ss_pkw_op(&s->w, SS_PK_BUILD));
out:
    Py_DECREF(d);
    return rc;
}

static int intern(PyObject **slot, const char *s)
{
    *slot = PyUnicode_InternFromString(s);
    return *slot == NULL ? -1 : 0;
}

static int tuple_arg(PyObject *o, Py_ssize_t n, const char *what)
{
    if (PyTuple_CheckExact(o) && (n < 0 || PyTuple_GET_SIZE(o) == n))
        return 0;
    PyErr_Format(PyExc_TypeError, "md_dumps: %s must be a tuple", what);
    return -1;
}

/* md_dumps(md, ctx) -> (bytes, used) | None. ctx: see writer._c_context. */
static PyObject *py_md_dumps(PyObject *m, PyObject *const *args,
                             Py_ssize_t nargs)
{
    ss_state *st = ss_get_state(m);
    PyObject *ctx, *res = NULL;
    mdw s;
    int rc;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "md_dumps(md, ctx)");
        return NULL;
    }
    ctx = args[1];
    if (tuple_arg(ctx, 10, "ctx") < 0 ||
        tuple_arg(PyTuple_GET_ITEM(ctx, 0), K_N, "ctx[0]") < 0 ||
        tuple_arg(PyTuple_GET_ITEM(ctx, 1), K_N, "ctx[1]") < 0 ||
        tuple_arg(PyTuple_GET_ITEM(ctx, 3), -1, "ctx[3]") < 0 ||
        tuple_arg(PyTuple_GET_ITEM(ctx, 4), -1, "ctx[4]") < 0 ||
        tuple_arg(PyTuple_GET_ITEM(ctx, 7), -1, "ctx[7]") < 0)
        return NULL;
    if (!PyType_Check(PyTuple_GET_ITEM(ctx, 5)) ||
        !PyDict_Check(PyTuple_GET_ITEM(ctx, 8))) {
        PyErr_SetString(PyExc_TypeError, "md_dumps: bad ctx");
        return NULL;
    }
    memset(&s, 0, sizeof(s));
    for (int i = 0; i < K_N; i++) {
        s.ok[i] = PyTuple_GET_ITEM(PyTuple_GET_ITEM(ctx, 0), i);
        s.cls[i] = PyTuple_GET_ITEM(PyTuple_GET_ITEM(ctx, 1), i);
        if (tuple_arg(s.ok[i], -1, "ctx[0][i]") < 0)
            return NULL;
    }
    s.size_cls = PyTuple_GET_ITEM(ctx, 2);
    s.native = PyTuple_GET_ITEM(ctx, 3);
    s.reducible = PyTuple_GET_ITEM(ctx, 4);
    s.purepath = PyTuple_GET_ITEM(ctx, 5);
    s.props_cb = PyTuple_GET_ITEM(ctx, 6);
    s.gs_known = PyTuple_GET_ITEM(ctx, 7);
    s.dispatch = PyTuple_GET_ITEM(ctx, 8);
    s.torch = PyObject_IsTrue(PyTuple_GET_ITEM(ctx, 9));
    if (s.torch < 0)
        return NULL;
#define NAME_INTERN(id, text)                                                  \
    if (intern(&s.names[id], text) < 0)                                        \
        goto done;
    NAME_LIST(NAME_INTERN)
#undef NAME_INTERN
    if (ss_pkmemo_init(&s.memo) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    ss_pkw_init(&s.w, 1 << 20);
    ss_pkw_start(&s.w);
    rc = write_md(&s, args[0]);
    if (rc == 0)
        rc = ss_pkw_finish(&s.w);
    if (s.decline && !PyErr_Occurred()) {
        res = Py_NewRef(Py_None);
    } else if (PyErr_Occurred()) {
        res = NULL;
    } else if (s.w.rc < 0) {
        res = ss_py_raise(st, s.w.rc, &s.w.err);
    } else {
        size_t n;
        const unsigned char *p = ss_pkw_data(&s.w, &n);
        PyObject *b = PyBytes_FromStringAndSize((const char *)p, (Py_ssize_t)n);
        if (b != NULL)
            res = Py_BuildValue("(Nk)", b, (unsigned long)s.used);
    }
done:
    {
        size_t pos = 0;
        uintptr_t key;
        while (ss_pkmemo_next(&s.memo, &pos, &key))
            Py_DECREF((PyObject *)key);
    }
    ss_pkmemo_destroy(&s.memo);
    ss_pkw_destroy(&s.w);
    for (int i = 0; i < N_NAMES; i++)
        Py_XDECREF(s.names[i]);
    return res;
}

static PyMethodDef mdwrite_methods[] = {
    {"md_dumps", (PyCFunction)(void (*)(void))py_md_dumps, METH_FASTCALL,
     "md_dumps(md, ctx, /)\n--\n\nThe .metadata pickle of md, as pickle.dumps "
     "writes the stand-in graph of writer._Convert.fast (placeholder module "
     "names not yet renamed): (bytes, used flags: 1 md, 2 fs, 4 size), or "
     "None where the fast path does not cover md."},
    {NULL, NULL, 0, NULL},
};

int ss_py_mdwrite_init(PyObject *m, ss_state *st)
{
    (void)st;
    return PyModule_AddFunctions(m, mdwrite_methods);
}
