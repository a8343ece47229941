/* ss_zipdtype.c - the tensor dtypes of a torch.save record (see header). */
#include "ss_zipdtype.h"

#include <string.h>

const ss_zip_dtype ss_zip_dtypes[] = {
    {"float64", 8, "DoubleStorage"},
    {"float32", 4, "FloatStorage"},
    {"float16", 2, "HalfStorage"},
    {"bfloat16", 2, "BFloat16Storage"},
    {"int64", 8, "LongStorage"},
    {"int32", 4, "IntStorage"},
    {"int16", 2, "ShortStorage"},
    {"int8", 1, "CharStorage"},
    {"uint8", 1, "ByteStorage"},
    {"bool", 1, "BoolStorage"},
    {"complex64", 8, "ComplexFloatStorage"},
    {"complex128", 16, "ComplexDoubleStorage"},
    {"uint16", 2, NULL},
    {"uint32", 4, NULL},
    {"uint64", 8, NULL},
    {"float8_e4m3fn", 1, NULL},
    {"float8_e5m2", 1, NULL},
    {"float8_e4m3fnuz", 1, NULL},
    {"float8_e5m2fnuz", 1, NULL},
    {"float8_e8m0fnu", 1, NULL},
    {"float4_e2m1fn_x2", 1, NULL},
    {"complex32", 4, NULL},
};

const int ss_zip_ndtypes =
    (int)(sizeof ss_zip_dtypes / sizeof ss_zip_dtypes[0]);

const ss_zip_dtype *ss_zip_dtype_find(const char *name)
{
    for (int i = 0; i < ss_zip_ndtypes; i++)
        if (strcmp(ss_zip_dtypes[i].name, name) == 0)
            return &ss_zip_dtypes[i];
    return NULL;
}
