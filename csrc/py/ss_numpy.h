/* ss_numpy.h - include NumPy's C API the same way in every csrc/py file.
 * module.c defines SS_IMPORT_NUMPY before including this, and calls
 * import_array() once; the other files share its API table. */
#ifndef SS_PY_NUMPY_H
#define SS_PY_NUMPY_H

#define NPY_NO_DEPRECATED_API NPY_1_21_API_VERSION
#define NPY_TARGET_VERSION NPY_1_21_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL ss_ARRAY_API
#ifndef SS_IMPORT_NUMPY
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#endif /* SS_PY_NUMPY_H */
