/* fuzz_zipread.c - libFuzzer harness for ss_zipread_tensor (csrc/core/
 * ss_zipread.c), the C recognition of a torch.save tensor record read from
 * a checkpoint's data file.
 *
 * Built with -fsanitize=fuzzer,address,undefined (make fuzz): any read past
 * the input, leak or undefined behaviour is a crash. Beyond that it checks
 * what ss_zipread.h promises of an accepted record:
 *  - the result is 0, SS_EINVAL or SS_ENOMEM;
 *  - the storage bytes lie inside the input; they hold storage_numel
 *    elements of the dtype's size exactly;
 *  - 0 <= ndim <= 64, sizes and strides >= 0, and a non-empty tensor's last
 *    element (offset + sum((size - 1) * stride)) lies inside the storage;
 *    an empty one's offset at most the storage's size;
 *  - conj only on a complex dtype;
 *  - recognition is deterministic: the same bytes give the same answer.
 * A violated property aborts, so libFuzzer keeps the input. */
#include "ss_zipread.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond)                                                            \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "fuzz_zipread: %s failed (line %d)\n", #cond,      \
                    __LINE__);                                                 \
            abort();                                                           \
        }                                                                      \
    } while (0)

int LLVMFuzzerTestOneInput(const unsigned char *data, size_t size)
{
    static ss_zip_tensor t, again;
    ss_errinfo err;
    int rc = ss_zipread_tensor(data, size, &t, &err), empty = 0;
    int64_t last = 0;

    CHECK(rc == 0 || rc == SS_EINVAL || rc == SS_ENOMEM);
    CHECK(ss_zipread_tensor(data, size, &again, &err) == rc);
    if (rc < 0)
        return 0;
    CHECK(memcmp(&t, &again, sizeof t) == 0);
    CHECK(t.dtype != NULL && t.itemsize >= 1 && t.itemsize <= 16);
    CHECK(t.data_offset <= size && t.data_length <= size - t.data_offset);
    CHECK(t.storage_numel >= 0 &&
          (uint64_t)t.storage_numel * t.itemsize == t.data_length);
    CHECK(t.ndim >= 0 && t.ndim <= SS_ZIP_MAX_NDIM);
    CHECK(t.storage_offset >= 0);
    for (int d = 0; d < t.ndim; d++) {
        CHECK(t.shape[d] >= 0 && t.stride[d] >= 0);
        empty |= t.shape[d] == 0;
    }
    if (empty) {
        CHECK(t.storage_offset <= t.storage_numel);
    } else {
        last = t.storage_offset;
        for (int d = 0; d < t.ndim; d++)
            last += (t.shape[d] - 1) * t.stride[d]; /* checked by the parser */
        CHECK(last < t.storage_numel);
    }
    CHECK(!t.conj || strncmp(t.dtype, "complex", 7) == 0);
    return 0;
}
