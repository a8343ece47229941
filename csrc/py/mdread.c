/* mdread.c - metadata_decode(): the fast path of the restricted .metadata
 * reader (python/shardstate/checkpoint/_pickle/fastread.py).
 *
 * ss_mdread decodes the stream into a node table with the GIL released;
 * this file walks the table once and makes shardstate's metadata classes
 * directly (object.__new__ and a __dict__, as build.py's _Builder.new), with
 * the checks of build.py and of the allowlist's stand-ins (allowlist.py).
 *
 * The fast path only ever answers with the Metadata the reference path
 * (unpickler.py + build.py) would give, or None: "not recognised, ask the
 * reference", which then decides, errors included. So anything unusual
 * gives None rather than an error: a global outside the small set decoded
 * here (the metadata classes, torch.Size, dtypes, layouts, memory formats,
 * the pathlib classes),
 * a state dict with a field the class does not know or a key twice, a dict
 * whose built keys collide, a value shared with itself (a cycle), nesting
 * past FAST_DEPTH_MAX, an int beyond int64, a string that is not UTF-8. Every
 * node of the table is reachable from the root and every one the walk
 * reaches is checked, so nothing in the stream escapes the allowlist.
 *
 * The context (ctx) comes from fastread.py, made for each call:
 *   (classes, globals, tp_defaults, size_type, memory_formats)
 * classes: the 8 metadata classes in CLS_* order; globals: {(module, name):
 * (code, obj)}, obj the value a global stands for (for a pathlib class, the
 * class build.py makes); tp_defaults: TensorProperties().__dict__; size_type:
 * torch.Size, or None (sizes are tuples); memory_formats: the 3 memory
 * formats _MEM_FORMAT_ENCODING 0..2 name; and, optionally, a 6th item
 * (lazy_min, make_chunks): a Metadata of at least lazy_min chunks in all has
 * each chunk list the stream shares nothing of (see lazy_chunks) made by
 * make_chunks(offsets, sizes, n, ndim) from two read-only int64 arrays
 * (n x ndim; views of the decoder's rows where it can) instead of n
 * ChunkStorageMetadata (_mdlazy.py). */
#include "module.h"
#include "ss_mdread.h"
#include "ss_numpy.h"

#include <string.h>

/* Below this many bytes releasing the GIL costs more than it saves. */
#define MD_NOGIL_MIN 65536
/* Deeper values go to the reference (build.py refuses past 100). */
#define FAST_DEPTH_MAX 64

enum {
    CLS_METADATA,
    CLS_TENSOR,
    CLS_PROPS,
    CLS_CHUNK,
    CLS_BYTES,
    CLS_INDEX,
    CLS_STORAGE_META,
    CLS_STORAGE_INFO,
    NCLS,
    G_SIZE = NCLS,
    G_DTYPE,
    G_MEMFMT,
    G_LAYOUT,
    G_MEMENC,
    G_PATH
};

/* The field names of every class, one table; F_* index it. */
#define FIELDS(X)                                                              \
    X(F_SDM, "state_dict_metadata")                                            \
    X(F_PLANNER, "planner_data")                                               \
    X(F_STORAGE, "storage_data")                                               \
    X(F_SMETA, "storage_meta")                                                 \
    X(F_VERSION, "version")                                                    \
    X(F_PROPERTIES, "properties")                                              \
    X(F_SIZE, "size")                                                          \
    X(F_CHUNKS, "chunks")                                                      \
    X(F_DTYPE, "dtype")                                                        \
    X(F_LAYOUT, "layout")                                                      \
    X(F_REQGRAD, "requires_grad")                                              \
    X(F_MEMFMT, "memory_format")                                               \
    X(F_PIN, "pin_memory")                                                     \
    X(F_OFFSETS, "offsets")                                                    \
    X(F_SIZES, "sizes")                                                        \
    X(F_FQN, "fqn")                                                            \
    X(F_OFFSET, "offset")                                                      \
    X(F_INDEX, "index")                                                        \
    X(F_CKPT, "checkpoint_id")                                                 \
    X(F_SAVE, "save_id")                                                       \
    X(F_LOAD, "load_id")                                                       \
    X(F_MODULES, "modules")                                                    \
    X(F_RELPATH, "relative_path")                                              \
    X(F_LENGTH, "length")                                                      \
    X(F_TD, "transform_descriptors")                                           \
    X(F_CRC, "shardstate_crc32")

enum {
#define X(id, s) id,
    FIELDS(X)
#undef X
        NFIELDS
};

static const char *const field_names[NFIELDS] = {
#define X(id, s) s,
    FIELDS(X)
#undef X
};

/* Each class's known fields (build.py's _F_*), in no particular order. */
static const int8_t known[NCLS][6] = {
    /* -1 ends a row */
    [CLS_METADATA] = {F_SDM, F_PLANNER, F_STORAGE, F_SMETA, F_VERSION, -1},
    [CLS_TENSOR] = {F_PROPERTIES, F_SIZE, F_CHUNKS, -1},
    [CLS_PROPS] = {F_DTYPE, F_LAYOUT, F_REQGRAD, F_MEMFMT, F_PIN, -1},
    [CLS_CHUNK] = {F_OFFSETS, F_SIZES, -1},
    [CLS_BYTES] = {-1},
    [CLS_INDEX] = {F_FQN, F_OFFSET, F_INDEX, -1},
    [CLS_STORAGE_META] = {F_CKPT, F_SAVE, F_LOAD, F_MODULES, -1},
    [CLS_STORAGE_INFO] = {F_RELPATH, F_OFFSET, F_LENGTH, F_TD, F_CRC, -1},
};

/* Rows of chunks, made while decoding (fold_batch): a list's batch of
 * ChunkStorageMetadata in torch's form (state {offsets, sizes}, two
 * torch.Size, nothing of it shared) becomes rows of int64 (offsets, then
 * sizes) and its nodes are dropped, so a large .metadata's table never
 * holds its chunks (issue 16). Plain C: it runs without the GIL. */
#define FOLD_NDIM_MAX 64
#define FOLD_KEYS_MAX 32
/* Row ids of storage entries start here (chunks' below). */
#define FOLD_SROW0 0x40000000u

/* A storage entry (MetadataIndex -> _StorageInfo) as fold_entry reads it:
 * the strings as a node index (a shared one: older than the batch, it
 * stays) or, with SD_FQN_FRESH / SD_PATH_FRESH, as (offset, length) in the
 * data. Only ever one at a time: entries go to the columns (scols). */
typedef struct srow {
    int64_t kidx, off, len;
    uint32_t fqn, path;
    uint32_t crc;
    uint16_t fqn_len, path_len;
    uint8_t flags; /* SD_* */
    int8_t kndim;  /* -1: the offset is None or absent */
    uint8_t kord;  /* the key's fields in order: 2 bits each (KF_*) */
} srow;

/* Storage entries as the columns make_storage gets (fastread.py's
 * _STORAGE_COLS: fid pid flags kndim koff kidx off len crc; koff holds
 * the keys' offset dims one after another), plus each key's field order
 * (kord, srow's). fold_batch appends to one set as the decoder goes, so a
 * large storage_data's entries are never nodes, nor rows to copy: the
 * arrays are handed to NumPy as they are (own_array). */
typedef struct scols {
    int32_t *fid, *pid;
    uint8_t *flags, *kord;
    int8_t *nd;
    int64_t *kidx, *off, *len;
    uint32_t *crc;
    size_t n, cap;
    int64_t *ko;
    size_t nko, kocap;
} scols;

/* The entries' strings (fqns, paths), each once: a shared one by its node
 * (one object per share slot, as value() makes it), a fresh one by its
 * bytes; (at, len) in the data either way. The ids are fid / pid. */
typedef struct sstr {
    uint32_t at, len, node; /* node: SSTR_FRESH for a fresh string */
} sstr;
#define SSTR_FRESH UINT32_MAX

typedef struct stab {
    sstr *s;
    size_t n, cap;
    uint32_t *ht; /* id + 1, or 0 */
    size_t htcap;
} stab;

/* Chunk rows of one ndim: offsets and sizes, n x ndim int64 each, the
 * arrays a ChunkList views (lazy_chunks); lent: the memory is the base
 * arrays' (bld.base) now. */
typedef struct cbuf {
    int64_t *off, *siz;
    size_t n, cap;
    int lent;
} cbuf;

/* Chunk rows g0 .. g0 + n - 1 (the ids fold_batch gave) are rows pos ..
 * of cb[nd]: one run for a list's rows in a row, whatever its batches. */
typedef struct crun {
    size_t g0, pos, n;
    uint32_t nd;
} crun;

typedef struct fold_name {
    const char *mod, *name; /* UTF-8 of the context's str keys */
    Py_ssize_t lmod, lname;
    int code; /* CLS_CHUNK or G_SIZE */
} fold_name;

typedef struct mdfold {
    const char *data;
    fold_name names[12];
    int nnames;
    cbuf cb[FOLD_NDIM_MAX + 1]; /* per ndim */
    crun *runs;
    size_t nruns, runcap;
    size_t nrows; /* chunk rows in all */
    scols sc;     /* the storage entries taken (row FOLD_SROW0 + i: entry i) */
    stab st;      /* their strings */
    /* shared strings a folded chunk used as a state key, and the field
     * each names (mark_keys marks them as it marks the table's) */
    uint32_t keys[FOLD_KEYS_MAX];
    int8_t keyf[FOLD_KEYS_MAX];
    int nkeys;
} mdfold;

typedef struct bld {
    const ss_md_result *r;
    mdfold *fold;
    size_t rows_used; /* chunk rows made into their lists so far */
    size_t *kstart;   /* per fold->sc entry: its first dim (col_dims) */
    size_t run;       /* the run row_at found last */
    PyObject *base[FOLD_NDIM_MAX + 1][2]; /* cb[nd]'s arrays, once lent */
    ss_md_node no_node; /* what N() gives for a row id (kind 0xff) */
    const char *data;
    PyObject **cache; /* per share slot: the built value */
    uint8_t *active;  /* per share slot: being built (a cycle if met) */
    uint8_t *keyof;   /* per share slot: field id + 1 of a state key, or 0 */
    PyObject *classes[NCLS];
    PyObject *globals, *tp_defaults, *size_type, *memfmt[3];
    PyObject *names[NFIELDS];
    PyObject *empty;
    PyObject *make_chunks;  /* borrowed; NULL: no compact chunk lists */
    PyObject *make_storage; /* borrowed; NULL: storage_data as a dict */
    long long lazy_min;
    int lazy; /* this Metadata has lazy_min chunks or more */
    int depth;
} bld;

/* A state dict read into slots: the value node of each field present and
 * the fields in the order they came. */
typedef struct fields {
    uint32_t node[NFIELDS];
    uint8_t has[NFIELDS];
    int8_t order[6];
    int n;
} fields;

/* Node i; a row id (or any index past the table) gives no_node, a kind
 * no check admits, so a row where no code expects one is "not ours". */
static const ss_md_node *N(const bld *b, uint32_t i)
{
    return i < b->r->nnodes ? &b->r->nodes[i] : &b->no_node;
}

static int is_row(const bld *b, uint32_t i)
{
    return (i & SS_MD_ROW_BIT) && b->fold != NULL &&
           (i & ~SS_MD_ROW_BIT) < b->fold->nrows;
}

/* A storage entry's row (its index in fold->sc), or -1. */
static int64_t srow_of(const bld *b, uint32_t i)
{
    uint32_t r = i & ~SS_MD_ROW_BIT;
    if (!(i & SS_MD_ROW_BIT) || b->fold == NULL || r < FOLD_SROW0 ||
        r - FOLD_SROW0 >= b->fold->sc.n)
        return -1;
    return (int64_t)(r - FOLD_SROW0);
}

/* Chunk row g's ndim, offsets and sizes. */
static uint32_t row_at(bld *b, size_t g, const int64_t **off,
                       const int64_t **siz)
{
    const mdfold *f = b->fold;
    const crun *u = &f->runs[b->run < f->nruns ? b->run : 0];
    if (g < u->g0 || g - u->g0 >= u->n) {
        size_t lo = 0, hi = f->nruns; /* the last run starting at or before g */
        while (hi - lo > 1) {
            size_t mid = lo + (hi - lo) / 2;
            if (f->runs[mid].g0 <= g)
                lo = mid;
            else
                hi = mid;
        }
        b->run = lo;
        u = &f->runs[lo];
    }
    if (u->nd == 0) { /* no cells (and no buffer) */
        static const int64_t none[1] = {0};
        *off = *siz = none;
        return 0;
    }
    *off = f->cb[u->nd].off + (u->pos + (g - u->g0)) * u->nd;
    *siz = f->cb[u->nd].siz + (u->pos + (g - u->g0)) * u->nd;
    return u->nd;
}

static PyObject *chunk_row(bld *b, uint32_t i);
static void fold_drop_chunks(mdfold *f);
static void drop_chunks(bld *b);
static PyObject *size_from(bld *b, const int64_t *v, uint32_t nd);

static const uint32_t *kids(const bld *b, const ss_md_node *n)
{
    return b->r->kids + n->a;
}

static int64_t ival(const ss_md_node *n)
{
    return (int64_t)((uint64_t)n->b << 32 | n->a);
}

static PyObject *value(bld *b, uint32_t i);
static PyObject *container(bld *b, const ss_md_node *n);

static PyObject *str_obj(const bld *b, const ss_md_node *n)
{
    return PyUnicode_DecodeUTF8(b->data + n->a, (Py_ssize_t)n->b,
                                "surrogatepass");
}

static int str_is(const bld *b, const ss_md_node *n, const char *s)
{
    size_t len = strlen(s);
    return n->kind == SS_MD_STR && n->b == len &&
           memcmp(b->data + n->a, s, len) == 0;
}

/* A GLOBAL node's (code, obj) from the context, borrowed; -1: not ours. */
static int global(bld *b, uint32_t i, PyObject **obj)
{
    const ss_md_node *n = N(b, i);
    PyObject *key, *mod, *name, *hit = NULL;
    long code;

    if (n->kind != SS_MD_GLOBAL)
        return -1;
    if (n->share && b->cache[n->share] != NULL) {
        hit = b->cache[n->share];
    } else {
        mod = str_obj(b, N(b, n->a));
        name = mod ? str_obj(b, N(b, n->b)) : NULL;
        key = name ? PyTuple_Pack(2, mod, name) : NULL;
        Py_XDECREF(mod);
        Py_XDECREF(name);
        if (key == NULL)
            return -1;
        hit = PyDict_GetItemWithError(b->globals, key);
        Py_DECREF(key);
        if (hit == NULL || !PyTuple_Check(hit) || PyTuple_GET_SIZE(hit) != 2)
            return -1;
        if (n->share)
            b->cache[n->share] = Py_NewRef(hit);
    }
    code = PyLong_AsLong(PyTuple_GET_ITEM(hit, 0));
    *obj = PyTuple_GET_ITEM(hit, 1);
    return code < 0 || code > G_PATH ? -1 : (int)code;
}

/* The class code of a NEWOBJ node made with no arguments; -1 otherwise. */
static int obj_class(bld *b, uint32_t i)
{
    const ss_md_node *n = N(b, i);
    PyObject *unused;
    int code;
    if (n->kind != SS_MD_NEWOBJ || N(b, n->b)->b != 0)
        return -1;
    code = global(b, n->a, &unused);
    return code < NCLS ? code : -1;
}

/* A REDUCE node of an allowlisted callable without BUILD: its code and
 * args (a tuple node); -1 otherwise. */
static int call_of(bld *b, uint32_t i, const ss_md_node **args, PyObject **obj)
{
    const ss_md_node *n = N(b, i);
    int code;
    if (n->kind != SS_MD_REDUCE || n->c)
        return -1;
    code = global(b, n->a, obj);
    if (code < G_SIZE)
        return -1;
    *args = N(b, n->b);
    return code;
}

/* torch.Size(...) node: its dims (int nodes); -1 otherwise. */
static int size_dims(bld *b, uint32_t i, const uint32_t **dims, uint32_t *nd)
{
    const ss_md_node *args, *t;
    PyObject *unused;
    if (call_of(b, i, &args, &unused) != G_SIZE)
        return -1;
    if (args->b == 0) {
        *dims = NULL;
        *nd = 0;
        return 0;
    }
    t = N(b, kids(b, args)[0]);
    if (args->b != 1 || t->kind != SS_MD_TUPLE)
        return -1;
    *dims = kids(b, t);
    *nd = t->b;
    for (uint32_t k = 0; k < t->b; k++)
        if (N(b, (*dims)[k])->kind != SS_MD_INT)
            return -1;
    return 0;
}

/* torch.Size(dims) as torch makes it (THPSize_pynew: tuple.__new__ of the
 * subtype, which copies the items into the subtype's tp_alloc), without
 * the intermediate tuple; a plain tuple without torch. */
static PyObject *size_obj(bld *b, uint32_t i)
{
    const uint32_t *dims;
    uint32_t nd;
    PyTypeObject *tp = (PyTypeObject *)b->size_type;
    PyObject *t;
    if (size_dims(b, i, &dims, &nd) < 0)
        return NULL;
    t = b->size_type == Py_None ? PyTuple_New(nd) : tp->tp_alloc(tp, nd);
    if (t == NULL)
        return NULL;
    for (uint32_t k = 0; k < nd; k++) {
        PyObject *v = PyLong_FromLongLong(ival(N(b, dims[k])));
        if (v == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, k, v);
    }
    return t;
}

/* A torch.Size field: size_obj through the node's share slot, so a Size
 * the stream shares (torch's pickle of one object used twice, as a chunk's
 * sizes and its tensor's size) is one object, as build.py's size() makes
 * it; NULL for any other node. */
static PyObject *size_val(bld *b, uint32_t i)
{
    const uint32_t *dims;
    uint32_t nd;
    return size_dims(b, i, &dims, &nd) < 0 ? NULL : value(b, i);
}

/* pathlib.<cls>(*parts) (allowlist.py's _path_ctor: parts must be str)
 * as build.py makes it: obj is the class build.path_class gives; NULL
 * otherwise. */
static PyObject *path_obj(bld *b, uint32_t i)
{
    const ss_md_node *args;
    PyObject *cls = NULL, *parts, *out;
    if (call_of(b, i, &args, &cls) != G_PATH || !PyType_Check(cls))
        return NULL;
    for (uint32_t k = 0; k < args->b; k++)
        if (N(b, kids(b, args)[k])->kind != SS_MD_STR)
            return NULL;
    parts = container(b, args);
    out = parts ? PyObject_Call(cls, parts, NULL) : NULL;
    Py_XDECREF(parts);
    return out;
}

/* A state (None, absent or a dict of str keys) into slots: -1 for a key
 * the class does not know, a key twice or any other state. */
static int read_state(bld *b, uint32_t state1, int cls, fields *f)
{
    const ss_md_node *d;
    const uint32_t *k;
    memset(f->has, 0, sizeof f->has);
    f->n = 0;
    if (state1 == 0 || N(b, state1 - 1)->kind == SS_MD_NONE)
        return 0;
    d = N(b, state1 - 1);
    if (d->kind != SS_MD_DICT)
        return -1;
    k = kids(b, d);
    for (uint32_t p = 0; p < d->b; p++) {
        const ss_md_node *key = N(b, k[2 * p]);
        int hit = -1;
        for (int j = 0; j < 6 && known[cls][j] >= 0; j++)
            if (str_is(b, key, field_names[known[cls][j]])) {
                hit = known[cls][j];
                break;
            }
        if (hit < 0 || f->has[hit] || f->n == 6)
            return -1;
        f->has[hit] = 1;
        f->node[hit] = k[2 * p + 1];
        f->order[f->n++] = (int8_t)hit;
    }
    return 0;
}

static const ss_md_node *field(const bld *b, const fields *f, int id)
{
    return f->has[id] ? N(b, f->node[id]) : NULL;
}

/* object.__new__(cls) with the items of d set as attributes (build.py's
 * _Builder.new: o.__dict__.update(d); fastread.py admits only classes
 * without a data descriptor named as a field, where the two agree); steals
 * d. */
static PyObject *new_obj(bld *b, int cls, PyObject *d)
{
    PyTypeObject *tp = (PyTypeObject *)b->classes[cls];
    PyObject *o = NULL, *k, *v;
    Py_ssize_t pos = 0;
    if (d == NULL)
        return NULL;
    o = PyBaseObject_Type.tp_new(tp, b->empty, NULL);
    while (o != NULL && PyDict_Next(d, &pos, &k, &v))
        if (PyObject_GenericSetAttr(o, k, v) < 0)
            Py_CLEAR(o);
    Py_DECREF(d);
    return o;
}

/* object.__new__(cls) with the fields in their order: each value from vals
 * (a new reference, or NULL: value(node)). Steals the references in vals.
 * Attributes are set one by one, so the instance keeps CPython's compact
 * per-instance values rather than a dict of its own. */
static PyObject *make(bld *b, int cls, const fields *f, PyObject **vals)
{
    PyTypeObject *tp = (PyTypeObject *)b->classes[cls];
    PyObject *o = PyBaseObject_Type.tp_new(tp, b->empty, NULL);
    for (int j = 0; j < f->n; j++) {
        int id = f->order[j];
        PyObject *v = vals[id];
        vals[id] = NULL;
        if (o != NULL && v == NULL)
            v = value(b, f->node[id]);
        if (o != NULL &&
            (v == NULL || PyObject_GenericSetAttr(o, b->names[id], v) < 0))
            Py_CLEAR(o);
        Py_XDECREF(v);
    }
    for (int id = 0; id < NFIELDS; id++)
        Py_CLEAR(vals[id]);
    return o;
}

/* The fields as a dict, for new_obj (see make). */
static PyObject *state_dict(bld *b, const fields *f, PyObject **vals)
{
    PyObject *d = PyDict_New();
    int ok = d != NULL;
    for (int j = 0; j < f->n; j++) {
        int id = f->order[j];
        PyObject *v = vals[id];
        vals[id] = NULL;
        if (ok && v == NULL)
            v = value(b, f->node[id]);
        ok = ok && v != NULL && PyDict_SetItem(d, b->names[id], v) == 0;
        Py_XDECREF(v);
    }
    for (int id = 0; id < NFIELDS; id++)
        Py_CLEAR(vals[id]);
    if (!ok)
        Py_CLEAR(d);
    return d;
}

static int is(const ss_md_node *n, int kind)
{
    return n != NULL && n->kind == kind;
}

static int str_or_none(const ss_md_node *n)
{
    return n == NULL || n->kind == SS_MD_STR || n->kind == SS_MD_NONE;
}

/* The chunks of every tensor entry of a state_dict_metadata dict node. */
static long long count_chunks(bld *b, const ss_md_node *sdm)
{
    long long total = 0;
    for (uint32_t p = 0; p < sdm->b; p++) {
        const ss_md_node *t = N(b, kids(b, sdm)[2 * p + 1]);
        fields f;
        if (t->kind == SS_MD_NEWOBJ &&
            read_state(b, t->c, CLS_TENSOR, &f) == 0 &&
            is(field(b, &f, F_CHUNKS), SS_MD_LIST))
            total += field(b, &f, F_CHUNKS)->b;
    }
    return total;
}

/* storage_data in the compact form (_mdlazy.StorageMap). */
enum {
    SD_FQN_FRESH = 1,  /* the key's fqn is a str of its own (not shared) */
    SD_PATH_FRESH = 2, /* the same for relative_path */
    SD_IDX_NONE = 4,   /* the key's index is None */
    SD_HAS_CRC = 8,    /* the info has shardstate_crc32 (4th field) */
    SD_CRC_NONE = 16,  /* ... which is None */
    SD_OFF_ABSENT = 32 /* the key has no offset field (torch: offset None) */
};

/* A key field's 2-bit code in srow.kord, and back. */
static const int kf_field[3] = {F_FQN, F_INDEX, F_OFFSET};

static int srow_kn(const srow *r)
{
    return r->flags & SD_OFF_ABSENT ? 2 : 3;
}

static int srow_kord(const srow *r, int j)
{
    return kf_field[(r->kord >> (2 * j)) & 3];
}

/* Whether key state f's field order agrees with the keys before it: fqn
 * before index or after it in all, offset (where present) at one place. */
static int key_order(const fields *f, int *fqn_first, int *offpos)
{
    int fi = -1, ii = -1, oi = -1;
    for (int j = 0; j < f->n; j++) {
        if (f->order[j] == F_FQN)
            fi = j;
        else if (f->order[j] == F_INDEX)
            ii = j;
        else
            oi = j;
    }
    if (*fqn_first < 0)
        *fqn_first = fi < ii;
    if (*fqn_first != (fi < ii))
        return -1;
    if (oi >= 0) {
        if (*offpos < 0)
            *offpos = oi;
        if (*offpos != oi)
            return -1;
    }
    return 0;
}

static int fold_entry(mdfold *f, const ss_md_result *t, uint32_t ki,
                      uint32_t vi, srow *r, int64_t *dims, int record);

static int fold_grow(void **a, size_t *cap, size_t need, size_t elem)
{
    size_t n = *cap ? *cap : 1024;
    void *p;
    if (need <= *cap)
        return 0;
    while (n < need)
        n *= 2;
    if (n > PY_SSIZE_T_MAX / elem ||
        (p = PyMem_RawRealloc(*a, n * elem)) == NULL)
        return -1;
    *a = p;
    *cap = n;
    return 0;
}

static uint64_t fnv(const char *p, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t k = 0; k < n; k++)
        h = (h ^ (unsigned char)p[k]) * 1099511628211ull;
    return h;
}

static uint64_t sstr_hash(const char *data, const sstr *e)
{
    uint64_t h = e->node == SSTR_FRESH
                     ? fnv(data + e->at, e->len)
                     : ((uint64_t)e->node + 1) * 0x9E3779B97F4A7C15ull;
    return h ^ (h >> 29);
}

/* The id of string e in t, added if new; -1: no memory (or ids). Plain C
 * (fold_batch runs without the GIL). */
static int64_t stab_id(stab *t, const char *data, const sstr *e)
{
    size_t m;
    if (2 * (t->n + 1) > t->htcap) {
        size_t cap = t->htcap ? 2 * t->htcap : 64;
        uint32_t *ht = PyMem_RawCalloc(cap, sizeof *ht);
        if (ht == NULL)
            return -1;
        for (size_t i = 0; i < t->n; i++) {
            for (m = sstr_hash(data, &t->s[i]) & (cap - 1); ht[m];
                 m = (m + 1) & (cap - 1))
                ;
            ht[m] = (uint32_t)i + 1;
        }
        PyMem_RawFree(t->ht);
        t->ht = ht;
        t->htcap = cap;
    }
    for (m = sstr_hash(data, e) & (t->htcap - 1); t->ht[m];
         m = (m + 1) & (t->htcap - 1)) {
        const sstr *q = &t->s[t->ht[m] - 1];
        if (q->node == e->node &&
            (e->node != SSTR_FRESH ||
             (q->len == e->len &&
              memcmp(data + q->at, data + e->at, e->len) == 0)))
            return t->ht[m] - 1;
    }
    if (t->n >= INT32_MAX - 1 ||
        fold_grow((void **)&t->s, &t->cap, t->n + 1, sizeof *t->s) < 0)
        return -1;
    t->s[t->n] = *e;
    t->ht[m] = (uint32_t)t->n + 1;
    return (int64_t)t->n++;
}

/* Room in c for n more entries and nko more offset dims; -1: no memory. */
static int scols_reserve(scols *c, size_t n, size_t nko)
{
    void **col[9] = {(void **)&c->fid,  (void **)&c->pid, (void **)&c->flags,
                     (void **)&c->kord, (void **)&c->nd,  (void **)&c->kidx,
                     (void **)&c->off,  (void **)&c->len, (void **)&c->crc};
    static const size_t width[9] = {4, 4, 1, 1, 1, 8, 8, 8, 4};
    if (c->n + n > c->cap) {
        size_t cap = c->cap ? c->cap : 1024;
        while (cap < c->n + n)
            cap *= 2;
        if (cap > (size_t)INT32_MAX)
            return -1;
        for (int j = 0; j < 9; j++) {
            void *p = PyMem_RawRealloc(*col[j], cap * width[j]);
            if (p == NULL)
                return -1;
            *col[j] = p;
        }
        c->cap = cap;
    }
    /* one more: ko is never NULL (memcpy, pointer sums) */
    return fold_grow((void **)&c->ko, &c->kocap, c->nko + nko + 1,
                     sizeof *c->ko);
}

static void scols_free(scols *c)
{
    PyMem_RawFree(c->fid);
    PyMem_RawFree(c->pid);
    PyMem_RawFree(c->flags);
    PyMem_RawFree(c->kord);
    PyMem_RawFree(c->nd);
    PyMem_RawFree(c->kidx);
    PyMem_RawFree(c->off);
    PyMem_RawFree(c->len);
    PyMem_RawFree(c->crc);
    PyMem_RawFree(c->ko);
    memset(c, 0, sizeof *c);
}

/* Entry r (its key offset's dims at dims) appended to c (reserved), its
 * strings through t; -1: no memory. */
static int col_push(scols *c, stab *t, const char *data,
                    const ss_md_result *res, const srow *r, const int64_t *dims)
{
    size_t p = c->n;
    sstr e;
    int64_t fid, pid;
    if (r->flags & SD_FQN_FRESH)
        e = (sstr){r->fqn, r->fqn_len, SSTR_FRESH};
    else
        e = (sstr){res->nodes[r->fqn].a, res->nodes[r->fqn].b, r->fqn};
    fid = stab_id(t, data, &e);
    if (r->flags & SD_PATH_FRESH)
        e = (sstr){r->path, r->path_len, SSTR_FRESH};
    else
        e = (sstr){res->nodes[r->path].a, res->nodes[r->path].b, r->path};
    pid = fid < 0 ? -1 : stab_id(t, data, &e);
    if (pid < 0)
        return -1;
    c->fid[p] = (int32_t)fid;
    c->pid[p] = (int32_t)pid;
    c->flags[p] = r->flags;
    c->kord[p] = r->kord;
    c->nd[p] = r->kndim;
    c->kidx[p] = r->flags & SD_IDX_NONE ? 0 : r->kidx;
    c->off[p] = r->off;
    c->len[p] = r->len;
    c->crc[p] = r->flags & SD_HAS_CRC && !(r->flags & SD_CRC_NONE) ? r->crc : 0;
    for (int j = 0; j < r->kndim; j++)
        c->ko[c->nko++] = dims[j];
    c->n++;
    return 0;
}

/* Where entry p's key offset dims start in b->fold->sc.ko (made once); NULL
 * with an exception set: no memory. */
static const int64_t *col_dims(bld *b, size_t p)
{
    const scols *c = &b->fold->sc;
    if (b->kstart == NULL) {
        size_t at = 0;
        if ((b->kstart = PyMem_Malloc((c->n + 1) * sizeof *b->kstart)) ==
            NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        for (size_t q = 0; q < c->n; q++) {
            b->kstart[q] = at;
            at += c->nd[q] > 0 ? (size_t)c->nd[q] : 0;
        }
    }
    return c->ko + b->kstart[p];
}

/* String id of the table as value() makes its node: a shared one's object
 * (one per share slot), a fresh one new. */
static PyObject *col_str(bld *b, int32_t id)
{
    const sstr *e = &b->fold->st.s[id];
    if (e->node != SSTR_FRESH)
        return value(b, e->node);
    return PyUnicode_DecodeUTF8(b->data + e->at, (Py_ssize_t)e->len,
                                "surrogatepass");
}

/* The MetadataIndex of folded entry p, as build_index makes it. */
static PyObject *index_row(bld *b, size_t p)
{
    const scols *c = &b->fold->sc;
    PyObject *vals[NFIELDS] = {0};
    fields f;
    memset(&f, 0, sizeof f);
    f.n = c->flags[p] & SD_OFF_ABSENT ? 2 : 3;
    for (int j = 0; j < f.n; j++) {
        int id = kf_field[(c->kord[p] >> (2 * j)) & 3];
        const int64_t *dv;
        f.order[j] = (int8_t)id;
        f.has[id] = 1;
        if (id == F_FQN)
            vals[id] = col_str(b, c->fid[p]);
        else if (id == F_INDEX)
            vals[id] = c->flags[p] & SD_IDX_NONE
                           ? Py_NewRef(Py_None)
                           : PyLong_FromLongLong(c->kidx[p]);
        else if (c->nd[p] < 0)
            vals[id] = Py_NewRef(Py_None);
        else if ((dv = col_dims(b, p)) != NULL)
            vals[id] = size_from(b, dv, (uint32_t)c->nd[p]);
        if (vals[id] == NULL) {
            for (int x = 0; x < NFIELDS; x++)
                Py_CLEAR(vals[x]);
            return NULL;
        }
    }
    return make(b, CLS_INDEX, &f, vals);
}

/* The _StorageInfo of folded entry p, as build_storage_info makes it. */
static PyObject *info_row(bld *b, size_t p)
{
    const scols *c = &b->fold->sc;
    PyObject *vals[NFIELDS] = {0};
    fields f;
    memset(&f, 0, sizeof f);
    f.n = c->flags[p] & SD_HAS_CRC ? 4 : 3;
    f.order[0] = F_RELPATH;
    f.order[1] = F_OFFSET;
    f.order[2] = F_LENGTH;
    f.order[3] = F_CRC;
    vals[F_RELPATH] = col_str(b, c->pid[p]);
    vals[F_OFFSET] = PyLong_FromLongLong(c->off[p]);
    vals[F_LENGTH] = PyLong_FromLongLong(c->len[p]);
    if (f.n == 4)
        vals[F_CRC] = c->flags[p] & SD_CRC_NONE
                          ? Py_NewRef(Py_None)
                          : PyLong_FromUnsignedLong(c->crc[p]);
    for (int j = 0; j < f.n; j++) {
        f.has[f.order[j]] = 1;
        if (vals[f.order[j]] == NULL) {
            for (int x = 0; x < NFIELDS; x++)
                Py_CLEAR(vals[x]);
            return NULL;
        }
    }
    return make(b, CLS_STORAGE_INFO, &f, vals);
}

static void own_free(PyObject *cap)
{
    PyMem_RawFree(PyCapsule_GetPointer(cap, "shardstate.mdread.column"));
}

/* A read-only 1-D array of n items of NumPy type `type` (elem bytes each)
 * over the raw buffer *p, which it then owns (*p NULL: freed with the
 * array); NULL on error (*p freed or still owned by the caller). */
static PyObject *own_array(void **p, size_t n, size_t elem, int type)
{
    void *q = PyMem_RawRealloc(*p, n ? n * elem : 1); /* no slack kept */
    npy_intp dim = (npy_intp)n;
    PyObject *cap, *a;
    if (q == NULL && (q = *p) == NULL)
        return PyErr_NoMemory();
    *p = NULL;
    if ((cap = PyCapsule_New(q, "shardstate.mdread.column", own_free)) ==
        NULL) {
        PyMem_RawFree(q);
        return NULL;
    }
    if ((a = PyArray_SimpleNewFromData(1, &dim, type, q)) == NULL) {
        Py_DECREF(cap);
        return NULL;
    }
    if (PyArray_SetBaseObject((PyArrayObject *)a, cap) < 0) { /* steals */
        Py_DECREF(a);
        return NULL;
    }
    PyArray_CLEARFLAGS((PyArrayObject *)a, NPY_ARRAY_WRITEABLE);
    return a;
}

/* Whether two of c's entries have one key (the dict's key equality:
 * MetadataIndex compares fqn and offset); -1: no memory. */
static int cols_dup_key(bld *b, const scols *c)
{
    const sstr *st = b->fold->st.s;
    size_t cap = 1, at = 0;
    uint32_t *ht, *ks;
    int dup = 0;
    while (cap < 2 * c->n)
        cap <<= 1;
    ht = PyMem_Calloc(cap, sizeof *ht);
    ks = PyMem_Malloc((c->n + 1) * sizeof *ks);
    if (ht == NULL || ks == NULL) {
        PyMem_Free(ht);
        PyMem_Free(ks);
        PyErr_NoMemory();
        return -1;
    }
    for (size_t p = 0; p < c->n && !dup; p++) {
        const sstr *s = &st[c->fid[p]];
        int kn = c->nd[p] > 0 ? c->nd[p] : 0;
        uint64_t h = fnv(b->data + s->at, s->len);
        ks[p] = (uint32_t)at;
        h = (h ^ (uint64_t)(c->nd[p] + 1)) * 1099511628211ull;
        for (int j = 0; j < kn; j++)
            h = (h ^ (uint64_t)c->ko[at + j]) * 1099511628211ull;
        h ^= h >> 29;
        for (size_t m = h & (cap - 1);; m = (m + 1) & (cap - 1)) {
            size_t q = ht[m];
            const sstr *o;
            if (q-- == 0) {
                ht[m] = (uint32_t)p + 1;
                break;
            }
            o = &st[c->fid[q]];
            if (o->len == s->len &&
                memcmp(b->data + o->at, b->data + s->at, s->len) == 0 &&
                c->nd[q] == c->nd[p] &&
                memcmp(c->ko + ks[q], c->ko + at, (size_t)kn * 8) == 0) {
                dup = 1;
                break;
            }
        }
        at += (size_t)kn;
    }
    PyMem_Free(ht);
    PyMem_Free(ks);
    return dup;
}

/* Moves c's last k entries (and their kd offset dims) to its front. */
static int cols_rotate(scols *c, size_t k, size_t kd)
{
    void *col[10] = {c->fid,  c->pid, c->flags, c->kord, c->nd,
                     c->kidx, c->off, c->len,   c->crc,  c->ko};
    static const size_t width[10] = {4, 4, 1, 1, 1, 8, 8, 8, 4, 8};
    char *tmp = PyMem_Malloc(k * 8 > kd * 8 ? k * 8 + 1 : kd * 8 + 1);
    if (tmp == NULL)
        return -1;
    for (int j = 0; j < 10; j++) {
        size_t n = j < 9 ? c->n : c->nko, m = j < 9 ? k : kd, w = width[j];
        char *a = col[j];
        memcpy(tmp, a + (n - m) * w, m * w);
        memmove(a + m * w, a, (n - m) * w);
        memcpy(a, tmp, m * w);
    }
    PyMem_Free(tmp);
    return 0;
}

/* storage_data (dict node d) as make_storage(key_order, strings,
 * columns...)'s compact form, in *out, where every entry is a
 * MetadataIndex {fqn, offset, index} (the 3 fields in one order for all
 * keys) -> _StorageInfo {relative_path, offset, length[,
 * shardstate_crc32]} (in that order; build_index's and build_storage_info's
 * checks) and the stream shares no key, info or offset Size (strings may
 * be shared: each string is one object per share slot, as value() makes
 * it): fold_entry's form, whether the decoder folded the entry (a row) or
 * not (a node pair). Where the dict's rows are all the columns, in order
 * (a large file's one storage_data: its first batch stays nodes, then
 * rows), the columns are the answer, the node pairs moved in front;
 * otherwise a copy. A key met twice (which the dict walk leaves to the
 * reference) fails. 0 with *out NULL for any other dict (the walk makes
 * it), -1 with *out NULL: not ours. */
static int lazy_storage(bld *b, const ss_md_node *d, PyObject **out)
{
    mdfold *f = b->fold;
    const uint32_t *k = kids(b, d);
    size_t n = d->b, lead = 0, dims = 0, ldims = 0, n0, nko0;
    scols own, *c = &own;
    srow r;
    int64_t dv[FOLD_NDIM_MAX];
    int fqn_first = -1, offpos = -1, korder[3], whole, rc = -1;
    PyObject *strs = NULL, *order = NULL, *arr[9] = {0};
    static const size_t width[9] = {4, 4, 1, 1, 8, 8, 8, 8, 4};
    static const int type[9] = {NPY_INT32, NPY_INT32, NPY_UINT8,
                                NPY_INT8,  NPY_INT64, NPY_INT64,
                                NPY_INT64, NPY_INT64, NPY_UINT32};

    *out = NULL;
    memset(&own, 0, sizeof own);
    if (d->kind != SS_MD_DICT || d->share || f == NULL)
        return 0;
    /* the forms, and the keys' field order, before anything changes */
    for (size_t p = 0; p < n; p++) {
        int64_t row = srow_of(b, k[2 * p]);
        fields kf;
        uint8_t kord;
        if (row >= 0) {
            if (srow_of(b, k[2 * p + 1]) != row)
                return 0;
            kord = f->sc.kord[row];
            kf.n = f->sc.flags[row] & SD_OFF_ABSENT ? 2 : 3;
            dims += f->sc.nd[row] > 0 ? (size_t)f->sc.nd[row] : 0;
        } else {
            if (fold_entry(f, b->r, k[2 * p], k[2 * p + 1], &r, NULL, 0) < 0)
                return 0;
            kord = r.kord;
            kf.n = srow_kn(&r);
            ldims += r.kndim > 0 ? (size_t)r.kndim : 0;
            lead += p == lead;
        }
        for (int j = 0; j < kf.n; j++)
            kf.order[j] = (int8_t)kf_field[(kord >> (2 * j)) & 3];
        if (key_order(&kf, &fqn_first, &offpos) < 0)
            return 0;
    }
    whole = f->sc.n == n - lead;
    for (size_t p = lead; whole && p < n; p++)
        whole = srow_of(b, k[2 * p]) == (int64_t)(p - lead);
    if (dims + ldims > UINT32_MAX)
        return 0;
    if (whole) {
        c = &f->sc;
        PyMem_Free(b->kstart); /* the rows move */
        b->kstart = NULL;
    }
    n0 = c->n;
    nko0 = c->nko;
    if (scols_reserve(c, whole ? lead : n, whole ? ldims : dims + ldims) < 0)
        goto nomem;
    for (size_t p = 0; p < n; p++) {
        int64_t row = srow_of(b, k[2 * p]);
        if (row < 0) {
            (void)fold_entry(f, b->r, k[2 * p], k[2 * p + 1], &r, dv, 0);
            if (col_push(c, &f->st, b->data, b->r, &r, dv) < 0)
                goto nomem;
        } else if (!whole) {
            const scols *s = &f->sc;
            const int64_t *sd = col_dims(b, (size_t)row);
            int kn = s->nd[row] > 0 ? s->nd[row] : 0;
            if (sd == NULL)
                goto fail;
            c->fid[c->n] = s->fid[row];
            c->pid[c->n] = s->pid[row];
            c->flags[c->n] = s->flags[row];
            c->kord[c->n] = s->kord[row];
            c->nd[c->n] = s->nd[row];
            c->kidx[c->n] = s->kidx[row];
            c->off[c->n] = s->off[row];
            c->len[c->n] = s->len[row];
            c->crc[c->n++] = s->crc[row];
            memcpy(c->ko + c->nko, sd, (size_t)kn * sizeof *sd);
            c->nko += (size_t)kn;
        }
    }
    if (whole && lead && cols_rotate(c, lead, c->nko - nko0) < 0)
        goto nomem;
    /* rows are no longer where their ids say (or handed over below) */
    if (whole)
        n0 = nko0 = 0;
    if ((rc = cols_dup_key(b, c)) != 0) /* a key twice: the reference */
        goto fail;
    rc = -1;
    if ((strs = PyList_New((Py_ssize_t)f->st.n)) == NULL)
        goto fail;
    for (size_t j = 0; j < f->st.n; j++) {
        PyObject *s = col_str(b, (int32_t)j);
        if (s == NULL)
            goto fail;
        PyList_SET_ITEM(strs, (Py_ssize_t)j, s);
    }
    korder[0] = fqn_first != 0 ? F_FQN : F_INDEX;
    korder[1] = fqn_first != 0 ? F_INDEX : F_FQN;
    korder[2] = F_OFFSET;
    for (int j = 2; offpos >= 0 && j > offpos; j--) {
        korder[j] = korder[j - 1];
        korder[j - 1] = F_OFFSET;
    }
    order = PyTuple_Pack(3, b->names[korder[0]], b->names[korder[1]],
                         b->names[korder[2]]);
    if (order == NULL)
        goto fail;
    {
        void **col[9] = {(void **)&c->fid, (void **)&c->pid, (void **)&c->flags,
                         (void **)&c->nd,  (void **)&c->ko,  (void **)&c->kidx,
                         (void **)&c->off, (void **)&c->len, (void **)&c->crc};
        size_t len[9] = {c->n, c->n, c->n, c->n, c->nko,
                         c->n, c->n, c->n, c->n};
        for (int j = 0; j < 9; j++)
            if ((arr[j] = own_array(col[j], len[j], width[j], type[j])) == NULL)
                goto fail;
    }
    *out = PyObject_CallFunction(b->make_storage, "OOOOOOOOOOO", order, strs,
                                 arr[0], arr[1], arr[2], arr[3], arr[4], arr[5],
                                 arr[6], arr[7], arr[8]);
    rc = *out != NULL ? 0 : -1;
    goto out;
nomem:
    PyErr_NoMemory();
fail:
    rc = -1;
out:
    if (c == &own || rc == 0 || arr[0] != NULL) {
        scols_free(c); /* what is left of it: the arrays own the rest */
    } else {
        c->n = n0; /* as it was (a failed move: n0 = 0, no rows) */
        c->nko = nko0;
    }
    for (int j = 0; j < 9; j++)
        Py_XDECREF(arr[j]);
    Py_XDECREF(order);
    Py_XDECREF(strs);
    return rc;
}

static PyObject *build_metadata(bld *b, const fields *f)
{
    PyObject *vals[NFIELDS] = {0}, *out;
    const ss_md_node *sdm = field(b, f, F_SDM), *sm = field(b, f, F_SMETA);
    const uint32_t *k;

    if (!is(sdm, SS_MD_DICT) || !str_or_none(field(b, f, F_VERSION)))
        return NULL;
    if (sm != NULL && sm->kind != SS_MD_NONE &&
        obj_class(b, f->node[F_SMETA]) != CLS_STORAGE_META)
        return NULL;
    if ((out = PyDict_New()) == NULL)
        return NULL;
    vals[F_SDM] = out;
    k = kids(b, sdm);
    b->lazy = b->make_chunks != NULL && count_chunks(b, sdm) >= b->lazy_min;
    for (uint32_t p = 0; p < sdm->b; p++) {
        int cls = obj_class(b, k[2 * p + 1]);
        PyObject *key, *v;
        Py_ssize_t before = PyDict_GET_SIZE(out);
        int ok;
        if (N(b, k[2 * p])->kind != SS_MD_STR ||
            (cls != CLS_TENSOR && cls != CLS_BYTES))
            goto fail;
        key = value(b, k[2 * p]);
        v = key ? value(b, k[2 * p + 1]) : NULL;
        ok = v != NULL && PyDict_SetItem(out, key, v) == 0 &&
             PyDict_GET_SIZE(out) > before;
        Py_XDECREF(key);
        Py_XDECREF(v);
        if (!ok)
            goto fail;
    }
    if (b->fold != NULL && b->fold->nrows && b->rows_used == b->fold->nrows)
        drop_chunks(b);
    if (b->lazy && b->make_storage != NULL && f->has[F_STORAGE] &&
        lazy_storage(b, N(b, f->node[F_STORAGE]), &vals[F_STORAGE]) < 0)
        goto fail;
    return make(b, CLS_METADATA, f, vals);
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *build_chunk(bld *b, const fields *f)
{
    const uint32_t *d1, *d2;
    uint32_t n1, n2;
    if (!f->has[F_OFFSETS] || !f->has[F_SIZES] ||
        size_dims(b, f->node[F_OFFSETS], &d1, &n1) < 0 ||
        size_dims(b, f->node[F_SIZES], &d2, &n2) < 0 || n1 != n2)
        return NULL;
    PyObject *vals[NFIELDS] = {0};
    vals[F_OFFSETS] = size_val(b, f->node[F_OFFSETS]);
    vals[F_SIZES] = vals[F_OFFSETS] ? size_val(b, f->node[F_SIZES]) : NULL;
    if (vals[F_SIZES] == NULL) {
        Py_XDECREF(vals[F_OFFSETS]);
        return NULL;
    }
    return make(b, CLS_CHUNK, f, vals);
}

/* Every chunk of a tensor inside it (build.py's _build_TensorStorageMetadata).
 */
static int chunks_inside(bld *b, const ss_md_node *list, const uint32_t *size,
                         uint32_t nd)
{
    const uint32_t *ck = kids(b, list);
    for (uint32_t c = 0; c < list->b; c++) {
        const ss_md_node *cn = N(b, ck[c]);
        const uint32_t *off, *len;
        uint32_t n1, n2;
        fields f;
        if (is_row(b, ck[c])) {
            const int64_t *vo, *vs;
            if (row_at(b, ck[c] & ~SS_MD_ROW_BIT, &vo, &vs) != nd)
                return -1;
            for (uint32_t k = 0; k < nd; k++) {
                int64_t o = vo[k], n = vs[k], s = ival(N(b, size[k]));
                if (o < 0 || n < 0 ||
                    (n != 0 &&
                     (s < 0 || (uint64_t)o + (uint64_t)n > (uint64_t)s)))
                    return -1;
            }
            continue;
        }
        if (read_state(b, cn->c, CLS_CHUNK, &f) < 0 || !f.has[F_OFFSETS] ||
            !f.has[F_SIZES] || size_dims(b, f.node[F_OFFSETS], &off, &n1) < 0 ||
            size_dims(b, f.node[F_SIZES], &len, &n2) < 0 || n1 != nd ||
            n2 != nd)
            return -1;
        for (uint32_t k = 0; k < nd; k++) {
            int64_t o = ival(N(b, off[k])), n = ival(N(b, len[k]));
            int64_t s = ival(N(b, size[k]));
            if (o < 0 || n < 0)
                return -1;
            if (n != 0 && (s < 0 || (uint64_t)o + (uint64_t)n > (uint64_t)s))
                return -1;
        }
    }
    return 0;
}

/* Whether a chunk list (checked by chunks_inside) stands for exactly the
 * objects lazy_chunks' list makes on demand: the stream shares neither the
 * list, nor a chunk, nor a chunk's offsets or sizes with anything (the
 * eager walk would make those one object, used twice), and each chunk's
 * state is {offsets, sizes} in that order (the attribute order _mdlazy
 * sets). */
static int lazy_ok(bld *b, const ss_md_node *list)
{
    const uint32_t *ck = kids(b, list);
    if (list->share)
        return 0;
    for (uint32_t c = 0; c < list->b; c++) {
        const ss_md_node *cn = N(b, ck[c]);
        fields f;
        if (is_row(b, ck[c]))
            continue; /* folded: nothing of it shared */
        if (cn->share || read_state(b, cn->c, CLS_CHUNK, &f) < 0 || f.n != 2 ||
            f.order[0] != F_OFFSETS || N(b, f.node[F_OFFSETS])->share ||
            N(b, f.node[F_SIZES])->share)
            return 0;
    }
    return 1;
}

/* cb[nd]'s rows pos .. pos + n - 1 as two read-only (n, nd) views of its
 * base arrays, made (the memory handed over) on first use; -1 on error. */
static int row_views(bld *b, uint32_t nd, size_t pos, size_t n, PyObject **off,
                     PyObject **siz)
{
    cbuf *c = &b->fold->cb[nd];
    npy_intp dims[2] = {(npy_intp)n, (npy_intp)nd};
    if (b->base[nd][0] == NULL) {
        size_t cells = c->n * nd;
        b->base[nd][0] = own_array((void **)&c->off, cells, 8, NPY_INT64);
        b->base[nd][1] = b->base[nd][0]
                             ? own_array((void **)&c->siz, cells, 8, NPY_INT64)
                             : NULL;
        c->lent = 1; /* the rest freed by fold_drop_chunks, if any */
        if (b->base[nd][1] == NULL)
            return -1;
        c->off = PyArray_DATA((PyArrayObject *)b->base[nd][0]);
        c->siz = PyArray_DATA((PyArrayObject *)b->base[nd][1]);
    }
    for (int j = 0; j < 2; j++) {
        PyObject *base = b->base[nd][j];
        int64_t *p = (int64_t *)PyArray_DATA((PyArrayObject *)base) + pos * nd;
        PyObject *v = PyArray_New(&PyArray_Type, 2, dims, NPY_INT64, NULL, p, 0,
                                  NPY_ARRAY_CARRAY_RO, NULL);
        if (v == NULL ||
            PyArray_SetBaseObject((PyArrayObject *)v, Py_NewRef(base)) < 0) {
            Py_XDECREF(v);
            if (j)
                Py_CLEAR(*off);
            return -1;
        }
        *(j ? siz : off) = v;
    }
    return 0;
}

/* make_chunks(offsets, sizes, n, ndim) over a chunk list lazy_ok admits:
 * read-only (n, ndim) int64 arrays, views of the rows where the list is
 * rows in a row of one run (a large file's lists), else a copy. */
static PyObject *lazy_chunks(bld *b, const ss_md_node *list, uint32_t nd)
{
    const uint32_t *ck = kids(b, list);
    size_t n = list->b, g0 = n ? ck[0] & ~SS_MD_ROW_BIT : 0;
    npy_intp dims[2] = {(npy_intp)n, (npy_intp)nd};
    PyObject *off = NULL, *len = NULL, *out = NULL;
    int view = n > 0 && nd > 0;
    for (size_t c = 0; view && c < n; c++)
        view = is_row(b, ck[c]) && (ck[c] & ~SS_MD_ROW_BIT) == g0 + c;
    if (view) {
        const int64_t *vo, *vs;
        const crun *u;
        (void)row_at(b, g0, &vo, &vs);
        u = &b->fold->runs[b->run];
        view = u->nd == nd && g0 + n - u->g0 <= u->n;
        if (view && row_views(b, nd, u->pos + (g0 - u->g0), n, &off, &len) < 0)
            return NULL;
    }
    if (view) {
        b->rows_used += n;
    } else {
        off = PyArray_SimpleNew(2, dims, NPY_INT64);
        len = off ? PyArray_SimpleNew(2, dims, NPY_INT64) : NULL;
        if (len == NULL)
            goto out;
        PyArray_CLEARFLAGS((PyArrayObject *)off, NPY_ARRAY_WRITEABLE);
        PyArray_CLEARFLAGS((PyArrayObject *)len, NPY_ARRAY_WRITEABLE);
    }
    for (uint32_t c = 0; !view && c < list->b; c++) {
        int64_t *po = (int64_t *)PyArray_DATA((PyArrayObject *)off) + c * nd;
        int64_t *pl = (int64_t *)PyArray_DATA((PyArrayObject *)len) + c * nd;
        const uint32_t *d1, *d2;
        uint32_t n1, n2;
        fields f;
        if (is_row(b, ck[c])) {
            const int64_t *vo, *vs;
            (void)row_at(b, ck[c] & ~SS_MD_ROW_BIT, &vo, &vs);
            memcpy(po, vo, nd * sizeof *vo);
            memcpy(pl, vs, nd * sizeof *vs);
            b->rows_used++;
            continue;
        }
        /* lazy_ok and chunks_inside checked every one of these */
        (void)read_state(b, N(b, ck[c])->c, CLS_CHUNK, &f);
        (void)size_dims(b, f.node[F_OFFSETS], &d1, &n1);
        (void)size_dims(b, f.node[F_SIZES], &d2, &n2);
        for (uint32_t k = 0; k < nd; k++) {
            po[k] = ival(N(b, d1[k]));
            pl[k] = ival(N(b, d2[k]));
        }
    }
    out = PyObject_CallFunction(b->make_chunks, "OOII", off, len,
                                (unsigned)list->b, (unsigned)nd);
out:
    Py_XDECREF(off);
    Py_XDECREF(len);
    return out;
}

static PyObject *build_tensor(bld *b, const fields *f)
{
    const ss_md_node *chunks = field(b, f, F_CHUNKS);
    const uint32_t *size;
    uint32_t nd;
    if (!f->has[F_PROPERTIES] || !f->has[F_SIZE] || !is(chunks, SS_MD_LIST) ||
        obj_class(b, f->node[F_PROPERTIES]) != CLS_PROPS ||
        size_dims(b, f->node[F_SIZE], &size, &nd) < 0)
        return NULL;
    for (uint32_t c = 0; c < chunks->b; c++)
        if (!is_row(b, kids(b, chunks)[c]) &&
            obj_class(b, kids(b, chunks)[c]) != CLS_CHUNK)
            return NULL;
    if (chunks_inside(b, chunks, size, nd) < 0)
        return NULL;
    PyObject *vals[NFIELDS] = {0};
    if (b->lazy && lazy_ok(b, chunks) &&
        (vals[F_CHUNKS] = lazy_chunks(b, chunks, nd)) == NULL)
        return NULL;
    vals[F_SIZE] = size_val(b, f->node[F_SIZE]);
    if (vals[F_SIZE] == NULL) {
        Py_XDECREF(vals[F_CHUNKS]);
        return NULL;
    }
    return make(b, CLS_TENSOR, f, vals);
}

/* One TensorProperties field: a new reference, or NULL (not ours). */
static PyObject *prop(bld *b, int id, uint32_t i)
{
    const ss_md_node *n = N(b, i), *args;
    PyObject *obj = NULL;
    int code;
    switch (id) {
    case F_REQGRAD:
    case F_PIN:
        if (n->kind != SS_MD_TRUE && n->kind != SS_MD_FALSE)
            return NULL;
        return Py_NewRef(n->kind == SS_MD_TRUE ? Py_True : Py_False);
    case F_DTYPE:
        return global(b, i, &obj) == G_DTYPE ? Py_NewRef(obj) : NULL;
    case F_LAYOUT: {
        PyObject *name, *hit;
        if (call_of(b, i, &args, &obj) != G_LAYOUT || args->b != 1 ||
            !PyDict_Check(obj))
            return NULL;
        n = N(b, kids(b, args)[0]);
        if (n->kind != SS_MD_STR || (name = str_obj(b, n)) == NULL)
            return NULL;
        hit = PyDict_GetItemWithError(obj, name);
        Py_DECREF(name);
        return hit ? Py_NewRef(hit) : NULL;
    }
    case F_MEMFMT:
        code = n->kind == SS_MD_GLOBAL ? global(b, i, &obj)
                                       : call_of(b, i, &args, &obj);
        if (code == G_MEMFMT)
            return Py_NewRef(obj);
        if (code != G_MEMENC || args->b != 1)
            return NULL;
        n = N(b, kids(b, args)[0]);
        if (n->kind != SS_MD_INT || ival(n) < 0 || ival(n) > 2 ||
            b->memfmt[ival(n)] == Py_None)
            return NULL;
        return Py_NewRef(b->memfmt[ival(n)]);
    default:
        return NULL;
    }
}

static PyObject *build_props(bld *b, uint32_t state1)
{
    static const int tuple_order[5] = {F_DTYPE, F_LAYOUT, F_REQGRAD, F_MEMFMT,
                                       F_PIN};
    const ss_md_node *st = state1 ? N(b, state1 - 1) : NULL;
    PyObject *d;
    fields f;

    if (is(st, SS_MD_TUPLE)) {
        if (st->b != 5)
            return NULL;
        f.n = 5;
        memset(f.has, 0, sizeof f.has);
        for (int j = 0; j < 5; j++) {
            f.has[tuple_order[j]] = 1;
            f.node[tuple_order[j]] = kids(b, st)[j];
            f.order[j] = (int8_t)tuple_order[j];
        }
    } else if (read_state(b, state1, CLS_PROPS, &f) < 0) {
        return NULL;
    }
    if ((d = PyDict_Copy(b->tp_defaults)) == NULL)
        return NULL;
    for (int j = 0; j < f.n; j++) {
        int id = f.order[j];
        PyObject *v = prop(b, id, f.node[id]);
        int rc = v ? PyDict_SetItem(d, b->names[id], v) : -1;
        Py_XDECREF(v);
        if (rc < 0) {
            Py_DECREF(d);
            return NULL;
        }
    }
    return new_obj(b, CLS_PROPS, d);
}

static PyObject *build_index(bld *b, const fields *f)
{
    const ss_md_node *off = field(b, f, F_OFFSET), *idx = field(b, f, F_INDEX);
    PyObject *vals[NFIELDS] = {0};
    if (!is(field(b, f, F_FQN), SS_MD_STR) ||
        !(idx == NULL || idx->kind == SS_MD_INT || idx->kind == SS_MD_NONE))
        return NULL;
    if (off != NULL && off->kind != SS_MD_NONE &&
        (vals[F_OFFSET] = size_val(b, f->node[F_OFFSET])) == NULL)
        return NULL;
    return make(b, CLS_INDEX, f, vals);
}

static PyObject *build_storage_meta(bld *b, const fields *f)
{
    const ss_md_node *mods = field(b, f, F_MODULES);
    PyObject *d, *unused;
    const ss_md_node *args;
    PyObject *vals[NFIELDS] = {0};
    /* checkpoint_id: a str, or the Path every save writes */
    if ((!str_or_none(field(b, f, F_CKPT)) &&
         call_of(b, f->node[F_CKPT], &args, &unused) != G_PATH) ||
        !str_or_none(field(b, f, F_SAVE)) || !str_or_none(field(b, f, F_LOAD)))
        return NULL;
    if (mods != NULL) {
        if (mods->kind != SS_MD_LIST)
            return NULL;
        for (uint32_t k = 0; k < mods->b; k++)
            if (N(b, kids(b, mods)[k])->kind != SS_MD_STR)
                return NULL;
    }
    d = state_dict(b, f, vals);
    if (d != NULL && mods == NULL) {
        PyObject *empty = PyList_New(0);
        if (empty == NULL || PyDict_SetItem(d, b->names[F_MODULES], empty) < 0)
            Py_CLEAR(d);
        Py_XDECREF(empty);
    }
    return new_obj(b, CLS_STORAGE_META, d);
}

static PyObject *build_storage_info(bld *b, const fields *f)
{
    const ss_md_node *td = field(b, f, F_TD), *crc = field(b, f, F_CRC);
    const ss_md_node *off = field(b, f, F_OFFSET), *len = field(b, f, F_LENGTH);
    PyObject *vals[NFIELDS] = {0};
    if (!is(field(b, f, F_RELPATH), SS_MD_STR) || !is(off, SS_MD_INT) ||
        !is(len, SS_MD_INT) || ival(off) < 0 || ival(len) < 0)
        return NULL;
    if (td != NULL && td->kind != SS_MD_NONE) {
        if (td->kind != SS_MD_LIST && td->kind != SS_MD_TUPLE)
            return NULL;
        for (uint32_t k = 0; k < td->b; k++)
            if (N(b, kids(b, td)[k])->kind != SS_MD_STR)
                return NULL;
    }
    if (crc != NULL && crc->kind != SS_MD_NONE &&
        (crc->kind != SS_MD_INT || ival(crc) < 0 ||
         ival(crc) > (int64_t)UINT32_MAX))
        return NULL;
    return make(b, CLS_STORAGE_INFO, f, vals);
}

static PyObject *build_class(bld *b, int cls, const ss_md_node *n)
{
    fields f;
    if (cls == CLS_PROPS)
        return build_props(b, n->c);
    if (read_state(b, n->c, cls, &f) < 0)
        return NULL;
    switch (cls) {
    case CLS_METADATA:
        return build_metadata(b, &f);
    case CLS_TENSOR:
        return build_tensor(b, &f);
    case CLS_CHUNK:
        return build_chunk(b, &f);
    case CLS_BYTES:
        return f.n == 0 ? PyObject_CallNoArgs(b->classes[CLS_BYTES]) : NULL;
    case CLS_INDEX:
        return build_index(b, &f);
    case CLS_STORAGE_META:
        return build_storage_meta(b, &f);
    case CLS_STORAGE_INFO:
        return build_storage_info(b, &f);
    default:
        return NULL;
    }
}

static PyObject *container(bld *b, const ss_md_node *n)
{
    const uint32_t *k = kids(b, n);
    PyObject *out, *v, *key;
    if (n->kind == SS_MD_TUPLE || n->kind == SS_MD_LIST) {
        int tuple = n->kind == SS_MD_TUPLE;
        out = tuple ? PyTuple_New(n->b) : PyList_New(n->b);
        for (uint32_t j = 0; out != NULL && j < n->b; j++) {
            if ((v = value(b, k[j])) == NULL)
                Py_CLEAR(out);
            else if (tuple)
                PyTuple_SET_ITEM(out, j, v);
            else
                PyList_SET_ITEM(out, j, v);
        }
        return out;
    }
    out = PyDict_New();
    for (uint32_t p = 0; out != NULL && p < n->b; p++) {
        Py_ssize_t before = PyDict_GET_SIZE(out);
        int64_t sr = srow_of(b, k[2 * p]);
        if (sr >= 0 && srow_of(b, k[2 * p + 1]) == sr) {
            key = index_row(b, (size_t)sr);
            v = key ? info_row(b, (size_t)sr) : NULL;
        } else {
            key = value(b, k[2 * p]);
            v = key ? value(b, k[2 * p + 1]) : NULL;
        }
        /* a key met twice: the reference merges the unbuilt keys first */
        if (v == NULL || PyDict_SetItem(out, key, v) < 0 ||
            PyDict_GET_SIZE(out) == before)
            Py_CLEAR(out);
        Py_XDECREF(key);
        Py_XDECREF(v);
    }
    return out;
}

static PyObject *value_(bld *b, uint32_t i)
{
    const ss_md_node *n = N(b, i), *args;
    PyObject *obj;
    int code;
    switch (n->kind) {
    case SS_MD_NONE:
        Py_RETURN_NONE;
    case SS_MD_TRUE:
        Py_RETURN_TRUE;
    case SS_MD_FALSE:
        Py_RETURN_FALSE;
    case SS_MD_INT:
        return PyLong_FromLongLong(ival(n));
    case SS_MD_FLOAT: {
        uint64_t u = (uint64_t)n->b << 32 | n->a;
        double d;
        memcpy(&d, &u, sizeof d);
        return PyFloat_FromDouble(d);
    }
    case SS_MD_STR:
        /* a string the stream shares with a state key is the attribute
         * name itself, as in the reference (which sets the stream's key) */
        if (n->share && b->keyof[n->share])
            return Py_NewRef(b->names[b->keyof[n->share] - 1]);
        return str_obj(b, n);
    case SS_MD_BYTES:
        return PyBytes_FromStringAndSize(b->data + n->a, (Py_ssize_t)n->b);
    case SS_MD_TUPLE:
    case SS_MD_LIST:
    case SS_MD_DICT:
        return container(b, n);
    case SS_MD_GLOBAL:
        code = global(b, i, &obj);
        return code == G_DTYPE || code == G_MEMFMT ? Py_NewRef(obj) : NULL;
    case SS_MD_NEWOBJ:
        code = obj_class(b, i);
        return code < 0 ? NULL : build_class(b, code, n);
    case SS_MD_REDUCE:
        code = call_of(b, i, &args, &obj);
        if (code == G_SIZE)
            return size_obj(b, i);
        if (code == G_PATH)
            return path_obj(b, i);
        return code == G_LAYOUT ? prop(b, F_LAYOUT, i) : NULL;
    default:
        return NULL;
    }
}

/* The value of node i (a new reference), built once if shared; NULL: not
 * recognised (an exception may be set; the caller clears it). */
static PyObject *value(bld *b, uint32_t i)
{
    const ss_md_node *n = N(b, i);
    PyObject *out;
    uint32_t s = n->share;
    if (is_row(b, i))
        return chunk_row(b, i & ~SS_MD_ROW_BIT);
    /* scalars need no cache; a GLOBAL's slot holds its context entry */
    if (n->kind <= SS_MD_FLOAT || n->kind == SS_MD_GLOBAL)
        return value_(b, i);
    if (s) {
        if (b->cache[s] != NULL)
            return Py_NewRef(b->cache[s]);
        if (b->active[s])
            return NULL; /* a value contains itself */
        b->active[s] = 1;
    }
    if (b->depth >= FAST_DEPTH_MAX)
        return NULL;
    b->depth++;
    out = value_(b, i);
    b->depth--;
    if (s) {
        b->active[s] = 0;
        if (out != NULL)
            b->cache[s] = Py_NewRef(out);
    }
    return out;
}

/* Marks the shared string nodes used as a state dict's key with the field
 * they name: one pass over the table, each slot matched once. */
static void mark_keys(bld *b)
{
    uint8_t *seen = b->active; /* free until the walk; cleared after */
    for (size_t i = 0; i < b->r->nnodes; i++) {
        const ss_md_node *n = &b->r->nodes[i], *d;
        if (n->kind != SS_MD_NEWOBJ || n->c == 0)
            continue;
        d = N(b, n->c - 1);
        if (d->kind != SS_MD_DICT)
            continue;
        for (uint32_t p = 0; p < d->b; p++) {
            const ss_md_node *key = N(b, kids(b, d)[2 * p]);
            uint32_t s = key->share;
            if (key->kind != SS_MD_STR || s == 0 || seen[s])
                continue;
            seen[s] = 1;
            for (int id = 0; id < NFIELDS; id++)
                if (str_is(b, key, field_names[id])) {
                    b->keyof[s] = (uint8_t)(id + 1);
                    break;
                }
        }
    }
    memset(seen, 0, (size_t)b->r->shared + 1);
    for (int k = 0; b->fold != NULL && k < b->fold->nkeys; k++) {
        const ss_md_node *key = N(b, b->fold->keys[k]);
        if (key->kind == SS_MD_STR && key->share)
            b->keyof[key->share] = (uint8_t)(b->fold->keyf[k] + 1);
    }
}

/* torch.Size(values) as size_obj makes it. */
static PyObject *size_from(bld *b, const int64_t *v, uint32_t nd)
{
    PyTypeObject *tp = (PyTypeObject *)b->size_type;
    PyObject *t =
        b->size_type == Py_None ? PyTuple_New(nd) : tp->tp_alloc(tp, nd);
    for (uint32_t k = 0; t != NULL && k < nd; k++) {
        PyObject *x = PyLong_FromLongLong(v[k]);
        if (x == NULL)
            Py_CLEAR(t);
        else
            PyTuple_SET_ITEM(t, k, x);
    }
    return t;
}

/* The ChunkStorageMetadata of row r, as build_chunk makes the chunk the
 * row was folded from (fold_chunk admits only that form). */
static PyObject *chunk_row(bld *b, uint32_t r)
{
    const int64_t *vo, *vs;
    uint32_t nd = row_at(b, r, &vo, &vs);
    b->rows_used++;
    PyObject *vals[NFIELDS] = {0};
    fields f;
    memset(&f, 0, sizeof f);
    f.n = 2;
    f.order[0] = F_OFFSETS;
    f.order[1] = F_SIZES;
    f.has[F_OFFSETS] = f.has[F_SIZES] = 1;
    vals[F_OFFSETS] = size_from(b, vo, nd);
    vals[F_SIZES] = vals[F_OFFSETS] ? size_from(b, vs, nd) : NULL;
    if (vals[F_SIZES] == NULL) {
        Py_XDECREF(vals[F_OFFSETS]);
        return NULL;
    }
    return make(b, CLS_CHUNK, &f, vals);
}

/* The code (CLS_CHUNK, G_SIZE) of GLOBAL node i in t; -1: another. */
static int fold_global(const mdfold *f, const ss_md_result *t, uint32_t i)
{
    const ss_md_node *g, *m, *n;
    if (i >= t->nnodes || (g = &t->nodes[i])->kind != SS_MD_GLOBAL)
        return -1;
    m = &t->nodes[g->a];
    n = &t->nodes[g->b];
    for (int k = 0; k < f->nnames; k++) {
        const fold_name *x = &f->names[k];
        if (m->b == x->lmod && n->b == x->lname &&
            memcmp(f->data + m->a, x->mod, (size_t)x->lmod) == 0 &&
            memcmp(f->data + n->a, x->name, (size_t)x->lname) == 0)
            return x->code;
    }
    return -1;
}

static int fold_str_is(const mdfold *f, const ss_md_node *n, const char *s)
{
    size_t len = strlen(s);
    return n->kind == SS_MD_STR && n->b == len &&
           memcmp(f->data + n->a, s, len) == 0;
}

/* A torch.Size REDUCE node i of ints, unshared, without BUILD: its dims
 * into out (if not NULL); -1 otherwise. */
static int fold_size(const mdfold *f, const ss_md_result *t, uint32_t i,
                     int64_t *out)
{
    const ss_md_node *n, *args, *d;
    if (i >= t->nnodes || (n = &t->nodes[i])->kind != SS_MD_REDUCE ||
        n->share || n->c || fold_global(f, t, n->a) != G_SIZE)
        return -1;
    args = &t->nodes[n->b];
    if (args->b == 0)
        return 0;
    if (args->b != 1 || t->kids[args->a] >= t->nnodes)
        return -1;
    d = &t->nodes[t->kids[args->a]];
    if (d->kind != SS_MD_TUPLE || d->b > FOLD_NDIM_MAX)
        return -1;
    for (uint32_t k = 0; k < d->b; k++) {
        uint32_t x = t->kids[d->a + k];
        if (x >= t->nnodes || t->nodes[x].kind != SS_MD_INT)
            return -1;
        if (out != NULL)
            out[k] = ival(&t->nodes[x]);
    }
    return (int)d->b;
}

/* A ChunkStorageMetadata NEWOBJ node i in the form chunk_row makes: its
 * ndim, the row written at out (if not NULL); -1 otherwise. */
static int fold_chunk(mdfold *f, const ss_md_result *t, uint32_t i,
                      int64_t *out)
{
    const ss_md_node *n, *st;
    const uint32_t *kv;
    int n1, n2;
    if (i >= t->nnodes || (n = &t->nodes[i])->kind != SS_MD_NEWOBJ ||
        n->share || n->c == 0 || t->nodes[n->b].b != 0 ||
        fold_global(f, t, n->a) != CLS_CHUNK)
        return -1;
    st = &t->nodes[n->c - 1];
    if (st->kind != SS_MD_DICT || st->share || st->c != SS_MD_ONE_RUN ||
        st->b != 2)
        return -1;
    kv = t->kids + st->a;
    for (int j = 0; j < 4; j++)
        if (kv[j] >= t->nnodes)
            return -1;
    if (!fold_str_is(f, &t->nodes[kv[0]], "offsets") ||
        !fold_str_is(f, &t->nodes[kv[2]], "sizes"))
        return -1;
    n1 = fold_size(f, t, kv[1], out);
    n2 = n1 < 0 ? -1 : fold_size(f, t, kv[3], out ? out + n1 : NULL);
    if (n1 < 0 || n2 != n1)
        return -1;
    for (int j = 0; out != NULL && j < 4; j += 2) {
        int k = 0;
        if (t->nodes[kv[j]].share == 0)
            continue;
        while (k < f->nkeys && f->keys[k] != kv[j])
            k++;
        if (k == f->nkeys) {
            f->keys[f->nkeys] = kv[j];
            f->keyf[f->nkeys++] = (int8_t)(j ? F_SIZES : F_OFFSETS);
        }
    }
    return n1;
}

/* Records shared string node k, a state key naming field id (mark_keys). */
static void fold_key(mdfold *f, const ss_md_result *t, uint32_t k, int id)
{
    int j = 0;
    if (t->nodes[k].share == 0)
        return;
    while (j < f->nkeys && f->keys[j] != k)
        j++;
    if (j == f->nkeys && f->nkeys < FOLD_KEYS_MAX) {
        f->keys[f->nkeys] = k;
        f->keyf[f->nkeys++] = (int8_t)id;
    }
}

/* The one-batch, unshared state dict of NEWOBJ node n of class cls with
 * 2..4 pairs: its kids; NULL otherwise. */
static const uint32_t *fold_state(const mdfold *f, const ss_md_result *t,
                                  uint32_t i, int cls, uint32_t *pairs)
{
    const ss_md_node *n, *st;
    const uint32_t *kv;
    if (i >= t->nnodes || (n = &t->nodes[i])->kind != SS_MD_NEWOBJ ||
        n->share || n->c == 0 || t->nodes[n->b].b != 0 ||
        fold_global(f, t, n->a) != cls)
        return NULL;
    st = &t->nodes[n->c - 1];
    /* c: one batch while decoding, 0 once flattened (or empty) */
    if (st->kind != SS_MD_DICT || st->share ||
        (st->c != SS_MD_ONE_RUN && st->c != 0) || st->b < 2 || st->b > 4)
        return NULL;
    kv = t->kids + st->a;
    for (uint32_t j = 0; j < 2 * st->b; j++)
        if (kv[j] >= t->nnodes)
            return NULL;
    *pairs = st->b;
    return kv;
}

static int fold_int(const ss_md_node *n, int64_t lo, int64_t hi, int64_t *v)
{
    if (n->kind != SS_MD_INT || ival(n) < lo || ival(n) > hi)
        return -1;
    *v = ival(n);
    return 0;
}

/* A storage entry (key node ki, value node vi) in the form lazy_storage
 * admits, into *r (its key offset's dims at dims, if not NULL): 0, or -1
 * (not this form; nothing recorded). */
static int fold_entry(mdfold *f, const ss_md_result *t, uint32_t ki,
                      uint32_t vi, srow *r, int64_t *dims, int record)
{
    static const int info[4] = {F_RELPATH, F_OFFSET, F_LENGTH, F_CRC};
    static const char *const info_name[4] = {"relative_path", "offset",
                                             "length", "shardstate_crc32"};
    const uint32_t *kv = NULL, *iv = NULL;
    uint32_t kp = 0, ip = 0;
    int seen = 0;
    int64_t crc = 0;
    const ss_md_node *x;
    memset(r, 0, sizeof *r);
    r->kndim = -1;
    r->flags = SD_OFF_ABSENT;
    if ((kv = fold_state(f, t, ki, CLS_INDEX, &kp)) == NULL || kp > 3 ||
        (iv = fold_state(f, t, vi, CLS_STORAGE_INFO, &ip)) == NULL || ip < 3)
        return -1;
    for (uint32_t p = 0; p < kp; p++) {
        const ss_md_node *key = &t->nodes[kv[2 * p]];
        int id = fold_str_is(f, key, "fqn")      ? F_FQN
                 : fold_str_is(f, key, "index")  ? F_INDEX
                 : fold_str_is(f, key, "offset") ? F_OFFSET
                                                 : -1;
        int bit = id == F_FQN ? 1 : id == F_INDEX ? 2 : 4;
        if (id < 0 || (seen & bit))
            return -1;
        seen |= bit;
        r->kord |= (uint8_t)((id == F_FQN     ? 0
                              : id == F_INDEX ? 1
                                              : 2)
                             << (2 * p));
        x = &t->nodes[kv[2 * p + 1]];
        if (id == F_FQN) {
            if (x->kind != SS_MD_STR)
                return -1;
            r->flags |= x->share ? 0 : SD_FQN_FRESH;
            r->fqn = x->share ? kv[2 * p + 1] : x->a;
            if (x->b > UINT16_MAX)
                return -1;
            r->fqn_len = (uint16_t)x->b;
        } else if (id == F_INDEX) {
            if (x->kind == SS_MD_NONE)
                r->flags |= SD_IDX_NONE;
            else if (fold_int(x, INT64_MIN, INT64_MAX, &r->kidx) < 0)
                return -1;
        } else {
            r->flags &= (uint8_t)~SD_OFF_ABSENT;
            if (x->kind != SS_MD_NONE &&
                (r->kndim = (int8_t)fold_size(f, t, kv[2 * p + 1], dims)) < 0)
                return -1;
        }
    }
    if (seen != 3 && seen != 7)
        return -1;
    for (uint32_t p = 0; p < ip; p++) {
        x = &t->nodes[iv[2 * p + 1]];
        if (!fold_str_is(f, &t->nodes[iv[2 * p]], info_name[p]))
            return -1;
        if (info[p] == F_RELPATH) {
            if (x->kind != SS_MD_STR)
                return -1;
            r->flags |= x->share ? 0 : SD_PATH_FRESH;
            r->path = x->share ? iv[2 * p + 1] : x->a;
            if (x->b > UINT16_MAX)
                return -1;
            r->path_len = (uint16_t)x->b;
        } else if (info[p] == F_CRC) {
            r->flags |= SD_HAS_CRC;
            if (x->kind == SS_MD_NONE)
                r->flags |= SD_CRC_NONE;
            else if (fold_int(x, 0, (int64_t)UINT32_MAX, &crc) < 0)
                return -1;
            r->crc = (uint32_t)crc;
        } else if (fold_int(x, 0, INT64_MAX,
                            info[p] == F_OFFSET ? &r->off : &r->len) < 0) {
            return -1;
        }
    }
    if (record) { /* the second pass: record the shared key names */
        for (uint32_t p = 0; p < kp; p++)
            fold_key(f, t, kv[2 * p], srow_kord(r, (int)p));
        for (uint32_t p = 0; p < ip; p++)
            fold_key(f, t, iv[2 * p], info[p]);
    }
    return 0;
}

/* ss_md_fold's batch: a list's batch of chunks in chunk_row's form (all of
 * them, or none) as rows. */
static int fold_batch(void *ctx, const ss_md_result *t, uint32_t ci,
                      const uint32_t *items, size_t n, uint32_t *row0)
{
    mdfold *f = ctx;
    size_t need = 0;
    int keys = 0;
    if (t->nodes[ci].kind == SS_MD_DICT) {
        srow r;
        int64_t dims[FOLD_NDIM_MAX];
        size_t n0 = f->sc.n, nko0 = f->sc.nko;
        if (f->nkeys + 8 > FOLD_KEYS_MAX ||
            f->sc.n + n / 2 >= SS_MD_ROW_BIT - FOLD_SROW0)
            return 0;
        for (size_t k = 0; k < n; k += 2) {
            if (fold_entry(f, t, items[k], items[k + 1], &r, NULL, 0) < 0)
                return 0;
            need += r.kndim > 0 ? (size_t)r.kndim : 0;
        }
        if (f->sc.nko + need > UINT32_MAX) /* lazy_storage's dims */
            return 0;
        if (scols_reserve(&f->sc, n / 2, need) < 0)
            return SS_ENOMEM;
        *row0 = FOLD_SROW0 + (uint32_t)f->sc.n;
        for (size_t k = 0; k < n; k += 2) {
            (void)fold_entry(f, t, items[k], items[k + 1], &r, dims, 1);
            if (col_push(&f->sc, &f->st, f->data, t, &r, dims) < 0) {
                f->sc.n = n0;
                f->sc.nko = nko0;
                return SS_ENOMEM;
            }
        }
        return 1;
    }
    if (t->nodes[ci].kind != SS_MD_LIST)
        return 0;
    {
        size_t cnt[FOLD_NDIM_MAX + 1] = {0};
        int64_t tmp[2 * FOLD_NDIM_MAX];
        for (size_t k = 0; k < n; k++) {
            int nd = fold_chunk(f, t, items[k], NULL);
            if (nd < 0)
                return 0;
            cnt[nd]++;
        }
        /* room for the keys it may record: at most two new a batch */
        for (int k = 0; k < 2; k++)
            keys += f->nkeys + k < FOLD_KEYS_MAX;
        if (keys < 2 || f->nrows + n >= FOLD_SROW0)
            return 0;
        for (int d = 1; d <= FOLD_NDIM_MAX; d++) {
            cbuf *c = &f->cb[d];
            size_t cap = c->cap;
            if (cnt[d] == 0)
                continue;
            if (fold_grow((void **)&c->off, &cap, c->n + cnt[d],
                          (size_t)d * sizeof *c->off) < 0 ||
                fold_grow((void **)&c->siz, &c->cap, c->n + cnt[d],
                          (size_t)d * sizeof *c->siz) < 0)
                return SS_ENOMEM;
        }
        if (fold_grow((void **)&f->runs, &f->runcap, f->nruns + n,
                      sizeof *f->runs) < 0)
            return SS_ENOMEM;
        *row0 = (uint32_t)f->nrows;
        for (size_t k = 0; k < n; k++) {
            int nd = fold_chunk(f, t, items[k], tmp);
            cbuf *c = &f->cb[nd];
            crun *u = f->nruns ? &f->runs[f->nruns - 1] : NULL;
            if (nd > 0) {
                memcpy(c->off + c->n * (size_t)nd, tmp, (size_t)nd * 8);
                memcpy(c->siz + c->n * (size_t)nd, tmp + nd, (size_t)nd * 8);
            }
            if (u != NULL && u->nd == (uint32_t)nd &&
                u->g0 + u->n == f->nrows && u->pos + u->n == c->n)
                u->n++;
            else
                f->runs[f->nruns++] = (crun){f->nrows, c->n, 1, (uint32_t)nd};
            c->n++;
            f->nrows++;
        }
    }
    return 1;
}

/* The context's names of ChunkStorageMetadata and torch.Size, for
 * fold_batch (which must not touch Python objects); 0: none (no fold). */
static int fold_prepare(mdfold *f, PyObject *ctx, const char *data)
{
    PyObject *g, *k, *v;
    Py_ssize_t pos = 0;
    int has_chunk = 0, has_size = 0;
    memset(f, 0, sizeof *f);
    f->data = data;
    if (!PyTuple_Check(ctx) || PyTuple_GET_SIZE(ctx) < 2 ||
        !PyDict_Check(g = PyTuple_GET_ITEM(ctx, 1)))
        return 0;
    while (PyDict_Next(g, &pos, &k, &v)) {
        long code;
        fold_name *x = &f->names[f->nnames];
        if (!PyTuple_Check(v) || PyTuple_GET_SIZE(v) != 2 ||
            !PyLong_Check(PyTuple_GET_ITEM(v, 0)) || !PyTuple_Check(k) ||
            PyTuple_GET_SIZE(k) != 2 ||
            !PyUnicode_Check(PyTuple_GET_ITEM(k, 0)) ||
            !PyUnicode_Check(PyTuple_GET_ITEM(k, 1)))
            continue;
        code = PyLong_AsLong(PyTuple_GET_ITEM(v, 0));
        if ((code != CLS_CHUNK && code != G_SIZE && code != CLS_INDEX &&
             code != CLS_STORAGE_INFO) ||
            f->nnames == 12)
            continue;
        x->mod = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(k, 0), &x->lmod);
        x->name =
            x->mod ? PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(k, 1), &x->lname)
                   : NULL;
        if (x->name == NULL) {
            PyErr_Clear();
            continue;
        }
        x->code = (int)code;
        has_chunk |= code == CLS_CHUNK;
        has_size |= code == G_SIZE;
        f->nnames++;
    }
    PyErr_Clear();
    return has_chunk && has_size;
}

static void fold_free(mdfold *f)
{
    fold_drop_chunks(f);
    scols_free(&f->sc);
    PyMem_RawFree(f->st.s);
    PyMem_RawFree(f->st.ht);
}

/* The chunk rows, once every one was made into its list: the storage
 * build that follows is a read's peak. Row ids left anywhere read "not
 * ours" from then on (is_row). */
static void fold_drop_chunks(mdfold *f)
{
    for (int d = 0; d <= FOLD_NDIM_MAX; d++) {
        if (!f->cb[d].lent) {
            PyMem_RawFree(f->cb[d].off);
            PyMem_RawFree(f->cb[d].siz);
        }
        memset(&f->cb[d], 0, sizeof f->cb[d]);
    }
    PyMem_RawFree(f->runs);
    f->runs = NULL;
    f->nruns = f->runcap = f->nrows = 0;
}

/* The chunk rows dropped (fold_drop_chunks) and the base arrays let go:
 * what a ChunkList views stays with it. */
static void drop_chunks(bld *b)
{
    for (int d = 0; d <= FOLD_NDIM_MAX; d++) {
        Py_CLEAR(b->base[d][0]);
        Py_CLEAR(b->base[d][1]);
    }
    if (b->fold != NULL)
        fold_drop_chunks(b->fold);
}

static int unpack_ctx(bld *b, PyObject *ctx)
{
    PyObject *cls, *mf;
    if (!PyTuple_Check(ctx) ||
        (PyTuple_GET_SIZE(ctx) != 5 && PyTuple_GET_SIZE(ctx) != 6))
        goto bad;
    if (PyTuple_GET_SIZE(ctx) == 6 && PyTuple_GET_ITEM(ctx, 5) != Py_None) {
        PyObject *lz = PyTuple_GET_ITEM(ctx, 5);
        if (!PyTuple_Check(lz) ||
            (PyTuple_GET_SIZE(lz) != 2 && PyTuple_GET_SIZE(lz) != 3) ||
            !PyLong_Check(PyTuple_GET_ITEM(lz, 0)) ||
            !PyCallable_Check(PyTuple_GET_ITEM(lz, 1)) ||
            (PyTuple_GET_SIZE(lz) == 3 &&
             !PyCallable_Check(PyTuple_GET_ITEM(lz, 2))))
            goto bad;
        if (PyTuple_GET_SIZE(lz) == 3)
            b->make_storage = PyTuple_GET_ITEM(lz, 2);
        b->lazy_min = PyLong_AsLongLong(PyTuple_GET_ITEM(lz, 0));
        if (b->lazy_min == -1 && PyErr_Occurred())
            return -1;
        b->make_chunks = PyTuple_GET_ITEM(lz, 1);
    }
    cls = PyTuple_GET_ITEM(ctx, 0);
    b->globals = PyTuple_GET_ITEM(ctx, 1);
    b->tp_defaults = PyTuple_GET_ITEM(ctx, 2);
    b->size_type = PyTuple_GET_ITEM(ctx, 3);
    mf = PyTuple_GET_ITEM(ctx, 4);
    if (!PyTuple_Check(cls) || PyTuple_GET_SIZE(cls) != NCLS ||
        !PyDict_Check(b->globals) || !PyDict_Check(b->tp_defaults) ||
        !PyTuple_Check(mf) || PyTuple_GET_SIZE(mf) != 3)
        goto bad;
    for (int j = 0; j < NCLS; j++) {
        b->classes[j] = PyTuple_GET_ITEM(cls, j);
        if (!PyType_Check(b->classes[j]))
            goto bad;
    }
    for (int j = 0; j < 3; j++)
        b->memfmt[j] = PyTuple_GET_ITEM(mf, j);
    /* size_type's instances are tuples made by tp_alloc (size_obj) */
    if (b->size_type != Py_None &&
        (!PyType_Check(b->size_type) ||
         !PyType_IsSubtype((PyTypeObject *)b->size_type, &PyTuple_Type) ||
         ((PyTypeObject *)b->size_type)->tp_itemsize != sizeof(PyObject *)))
        goto bad;
    return 0;
bad:
    PyErr_SetString(PyExc_TypeError, "metadata_decode: malformed context");
    return -1;
}

static PyObject *build(const ss_md_result *r, const char *data, PyObject *ctx,
                       mdfold *fold)
{
    bld b;
    PyObject *out = NULL;
    memset(&b, 0, sizeof b);
    b.r = r;
    b.fold = fold;
    b.no_node.kind = 0xff;
    b.data = data;
    if (unpack_ctx(&b, ctx) < 0)
        return NULL;
    b.cache = PyMem_Calloc((size_t)r->shared + 1, sizeof *b.cache);
    b.active = PyMem_Calloc((size_t)r->shared + 1, 1);
    b.keyof = PyMem_Calloc((size_t)r->shared + 1, 1);
    b.empty = PyTuple_New(0);
    if (b.cache == NULL || b.active == NULL || b.keyof == NULL ||
        b.empty == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (int j = 0; j < NFIELDS; j++)
        if ((b.names[j] = PyUnicode_InternFromString(field_names[j])) == NULL)
            goto out;
    mark_keys(&b);
    if (obj_class(&b, r->root) == CLS_METADATA)
        out = value(&b, r->root);
    if (out == NULL) {
        PyErr_Clear(); /* not recognised: the reference decides */
        out = Py_NewRef(Py_None);
    }
out:
    if (b.cache != NULL)
        for (uint32_t s = 0; s <= r->shared; s++)
            Py_XDECREF(b.cache[s]);
    PyMem_Free(b.cache);
    PyMem_Free(b.active);
    PyMem_Free(b.keyof);
    PyMem_Free(b.kstart);
    drop_chunks(&b);
    Py_XDECREF(b.empty);
    for (int j = 0; j < NFIELDS; j++)
        Py_XDECREF(b.names[j]);
    return out;
}

static PyObject *py_metadata_decode(PyObject *m, PyObject *const *args,
                                    Py_ssize_t nargs)
{
    ss_mdread *r = NULL;
    ss_errinfo err;
    Py_buffer view;
    PyObject *out;
    mdfold fold;
    ss_md_fold hook = {fold_batch, &fold};
    const ss_md_fold *use;
    int rc;

    (void)m;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError,
                        "metadata_decode(data, ctx) takes 2 arguments");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    ss_errinfo_clear(&err);
    use = fold_prepare(&fold, args[1], view.buf) ? &hook : NULL;
    /* The view keeps the buffer mapped and its size fixed while the GIL is
     * released; a writable one (a bytearray) could still change under the
     * decoder, so it is decoded with the GIL held. */
    if (view.len >= MD_NOGIL_MIN && view.readonly) {
        Py_BEGIN_ALLOW_THREADS
            rc = ss_mdread_decode_fold(view.buf, (size_t)view.len, use, &r,
                                       &err);
        Py_END_ALLOW_THREADS
    } else {
        rc = ss_mdread_decode_fold(view.buf, (size_t)view.len, use, &r, &err);
    }
    if (rc < 0)
        out = Py_NewRef(Py_None); /* not decoded: the reference decides */
    else
        out = build(ss_mdread_result(r), view.buf, args[1], &fold);
    ss_mdread_free(r);
    fold_free(&fold);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef mdread_methods[] = {
    {"metadata_decode", (PyCFunction)(void (*)(void))py_metadata_decode,
     METH_FASTCALL,
     "metadata_decode(data, ctx, /)\n--\n\nThe fast path of the restricted "
     ".metadata reader: the Metadata the reference reader would make from "
     "data, or None where it does not recognise the stream (the reference "
     "then decides). ctx: see csrc/py/mdread.c."},
    {NULL, NULL, 0, NULL},
};

int ss_py_mdread_init(PyObject *m, ss_state *st)
{
    (void)st;
    return PyModule_AddFunctions(m, mdread_methods);
}
