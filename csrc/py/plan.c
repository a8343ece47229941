/* plan.c - with_index_hints(): the coordinator's per-item copies for DCP's
 * global save plan (shardstate/checkpoint/default_planner.py).
 *
 * create_global_plan gives every tensor item of every rank's plan a new
 * MetadataIndex whose index hint is the chunk's position in the metadata:
 * dataclasses.replace twice per item, millions of items at thousands of
 * ranks. The classes are frozen dataclasses whose init only stores their
 * fields, so a copy is object.__new__ plus the instance attributes set
 * again with one of them changed; done here, it costs a few hundred
 * nanoseconds. The caller checks the classes (exactly WriteItem and
 * MetadataIndex); this file only needs objects with an instance dict. Runs
 * with the GIL held. PyDict_Next over the source's dict is safe: setting
 * attributes on the new object never touches it.
 */
#include "module.h"

/* object.__new__(type(obj)) given obj's instance attributes, in obj's
 * order, with name set to value; NULL with an error set. The attributes
 * are set as object.__setattr__ sets them (a frozen dataclass's own
 * __setattr__ is bypassed, as its __init__ bypasses it), so the copy keeps
 * its attributes in the object's inline values, as one made by __init__
 * does, instead of a dict of its own. */
static PyObject *copy_with(PyObject *obj, PyObject *name, PyObject *value,
                           PyObject *noargs)
{
    PyObject *res, *src, *k, *v;
    Py_ssize_t pos = 0;
    int seen = 0;

    res = PyBaseObject_Type.tp_new(Py_TYPE(obj), noargs, NULL);
    if (res == NULL)
        return NULL;
    src = PyObject_GenericGetDict(obj, NULL);
    if (src == NULL)
        goto fail;
    while (PyDict_Next(src, &pos, &k, &v)) {
        int same = k == name ? 1 : PyObject_RichCompareBool(k, name, Py_EQ);
        if (same < 0)
            goto fail;
        seen |= same;
        if (PyObject_GenericSetAttr(res, k, same ? value : v) < 0)
            goto fail;
    }
    if (!seen && PyObject_GenericSetAttr(res, name, value) < 0)
        goto fail;
    Py_DECREF(src);
    return res;
fail:
    Py_XDECREF(src);
    Py_DECREF(res);
    return NULL;
}

static PyObject *py_with_index_hints(PyObject *module, PyObject *const *args,
                                     Py_ssize_t nargs)
{
    PyObject *items = NULL, *hints = NULL, *out = NULL, *name = NULL;
    PyObject *noargs = NULL;
    Py_ssize_t n;
    (void)module;

    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError,
                        "with_index_hints(items, hints) takes 2 arguments");
        return NULL;
    }
    items = PySequence_Fast(args[0], "with_index_hints: items must be a "
                                     "sequence");
    if (items == NULL)
        return NULL;
    hints = PySequence_Fast(args[1], "with_index_hints: hints must be a "
                                     "sequence");
    if (hints == NULL)
        goto out;
    n = PySequence_Fast_GET_SIZE(items);
    if (PySequence_Fast_GET_SIZE(hints) != n) {
        PyErr_Format(PyExc_ValueError,
                     "with_index_hints: %zd items but %zd hints", n,
                     PySequence_Fast_GET_SIZE(hints));
        goto out;
    }
    name = PyUnicode_InternFromString("index");
    noargs = PyTuple_New(0);
    if (name == NULL || noargs == NULL)
        goto out;
    out = PyList_New(n);
    if (out == NULL)
        goto out;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(items, i);
        PyObject *index, *new_index, *new_item;

        index = PyObject_GetAttr(item, name);
        if (index == NULL)
            goto fail;
        new_index =
            copy_with(index, name, PySequence_Fast_GET_ITEM(hints, i), noargs);
        Py_DECREF(index);
        if (new_index == NULL)
            goto fail;
        new_item = copy_with(item, name, new_index, noargs);
        Py_DECREF(new_index);
        if (new_item == NULL)
            goto fail;
        PyList_SET_ITEM(out, i, new_item);
    }
    goto out;
fail:
    Py_CLEAR(out);
out:
    Py_XDECREF(noargs);
    Py_XDECREF(name);
    Py_XDECREF(hints);
    Py_DECREF(items);
    return out;
}

static PyMethodDef plan_methods[] = {
    {"with_index_hints", (PyCFunction)(void (*)(void))py_with_index_hints,
     METH_FASTCALL,
     "with_index_hints(items, hints)\n--\n\n"
     "[replace(item, index=replace(item.index, index=hint))]: each item and "
     "its .index copied by object.__new__ and object.__setattr__ of each "
     "instance attribute, 'index' set (for dataclasses whose init only "
     "stores fields; the caller checks the classes)."},
    {NULL, NULL, 0, NULL},
};

int ss_py_plan_init(PyObject *m, ss_state *st)
{
    (void)st;
    return PyModule_AddFunctions(m, plan_methods);
}
