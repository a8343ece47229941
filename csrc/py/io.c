/* io.c - placeholder; filled in by the io work. */
#include "module.h"

int ss_py_io_init(PyObject *m, ss_state *st)
{
    (void)m;
    (void)st;
    return 0;
}
