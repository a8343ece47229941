/* geom.c - placeholder; filled in by the geom work. */
#include "module.h"

int ss_py_geom_init(PyObject *m, ss_state *st)
{
    (void)m;
    (void)st;
    return 0;
}
