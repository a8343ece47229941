/* ss_dl.h - load a shared library at run time into a table of function
 * pointers, once, and say why when it cannot be used.
 *
 * The CUDA runtime and NCCL are never linked: ss_cuda and ss_nccl describe
 * their tables with an ss_dl_spec (symbol names and where each pointer goes)
 * and ss_dl_load() does the rest: it tries each candidate name or path in
 * order with dlopen(RTLD_NOW | RTLD_LOCAL), resolves every symbol, runs the
 * spec's check (a version check), and returns the first table that passes.
 * When none does, the reason names each candidate and what was wrong with it
 * ("not found", "missing symbol cudaEventQuery", "CUDA runtime 10.2 is older
 * than the minimum 11.0"), and the return value is SS_ENOTAVAIL.
 *
 * Invariants: a table that passed is published in a process-wide registry and
 * never freed or unloaded (unloading the CUDA runtime or NCCL under a live
 * process is not safe), so the pointer returned stays valid and immutable for
 * the life of the process. Asking again for a library that is already loaded
 * (the same dlopen handle: same file, by path or soname) returns the same
 * table without running its check again. A candidate that fails is closed
 * again and tried afresh on the next call. The registry is the core's one
 * piece of process-wide state; it mirrors the dynamic linker's own.
 *
 * Thread safety: ss_dl_load may be called from any thread; loads are
 * serialised by one mutex. Returned tables are read-only.
 */
#ifndef SS_DL_H
#define SS_DL_H

#include <stddef.h>

#define SS_DL_PATH_MAX 512
#define SS_DL_REASON_MAX 1024

/* First member of every table: filled by ss_dl_load. */
typedef struct ss_dl_lib {
    char path[SS_DL_PATH_MAX];    /* the file actually loaded (realpath) */
    void *handle;                 /* dlopen handle, never closed */
    const void *spec;             /* the ss_dl_spec it was loaded for */
    const struct ss_dl_lib *next; /* registry link (internal) */
} ss_dl_lib;

typedef struct ss_dl_sym {
    const char *name; /* symbol to dlsym */
    size_t offset;    /* offset of its function-pointer member in the table */
} ss_dl_sym;

/* Called with every symbol resolved; the check may call into the library
 * (version functions) and fill the table's own fields. Returns 0, or
 * SS_ENOTAVAIL with a short reason written to why (without the path). */
typedef int (*ss_dl_check_fn)(void *table, char *why, size_t why_len);

typedef struct ss_dl_spec {
    const char *what;            /* "libcudart": names it in reasons */
    const char *const *defaults; /* candidates when the caller gives none */
    size_t ndefaults;
    const ss_dl_sym *syms;
    size_t nsyms;
    size_t table_size;    /* sizeof the table; starts with ss_dl_lib */
    ss_dl_check_fn check; /* may be NULL */
} ss_dl_spec;

/* Load the first usable candidate (cands[0..n), or spec->defaults when
 * cands is NULL) and store its table in *out. Returns 0, SS_ENOTAVAIL with
 * the reason in reason[reason_len] (always NUL-terminated, may be cut with
 * "..."), SS_EINVAL for an empty candidate list, or SS_ENOMEM. reason may
 * be NULL. */
int ss_dl_load(const ss_dl_spec *spec, const char *const *cands, size_t n,
               const void **out, char *reason, size_t reason_len);

#endif /* SS_DL_H */
