/* ss_dl.c - run-time library loading into function tables (see ss_dl.h).
 * Thread safety: one mutex serialises loads and guards the registry;
 * published tables are immutable. */
#include "ss_dl.h"

#include "ss_error.h"

#include <dlfcn.h>
#include <limits.h>
#include <link.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static const ss_dl_lib *registry; /* newest first; entries never freed */

/* Append-only text in a fixed buffer; len counts what did not fit too. */
typedef struct {
    char *buf;
    size_t cap, len;
} text;

static void text_add(text *t, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

static void text_add(text *t, const char *fmt, ...)
{
    va_list ap;
    int k;

    if (t->buf == NULL || t->cap == 0)
        return;
    va_start(ap, fmt);
    k = vsnprintf(t->buf + (t->len < t->cap ? t->len : t->cap - 1),
                  t->len < t->cap ? t->cap - t->len : 1, fmt, ap);
    va_end(ap);
    if (k > 0)
        t->len += (size_t)k;
}

/* Mark a cut with "..." when something did not fit. */
static void text_finish(text *t)
{
    if (t->buf == NULL || t->cap == 0)
        return;
    if (t->len >= t->cap && t->cap >= 4)
        memcpy(t->buf + t->cap - 4, "...", 4);
}

/* The file behind a handle, resolved; falls back to the candidate name. */
static void loaded_path(void *h, const char *cand, char *out, size_t len)
{
    struct link_map *lm = NULL;
    char real[PATH_MAX];
    const char *p = cand;
    size_t n;

    if (dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm != NULL &&
        lm->l_name != NULL && lm->l_name[0] != '\0')
        p = lm->l_name;
    if (realpath(p, real) != NULL)
        p = real;
    /* A path longer than the field is cut (it is for messages only). */
    n = strlen(p);
    if (n >= len)
        n = len - 1;
    memcpy(out, p, n);
    out[n] = '\0';
}

/* dlopen's message for cand, shortened: "not found" for a missing file,
 * otherwise the text after the "<cand>: " prefix the loader puts first. */
static const char *open_error(const char *cand, const char *err)
{
    size_t n = strlen(cand);

    if (err == NULL)
        return "dlopen failed";
    if (strstr(err, "No such file or directory") != NULL)
        return "not found";
    if (strncmp(err, cand, n) == 0 && err[n] == ':' && err[n + 1] == ' ')
        return err + n + 2;
    return err;
}

/* Try one candidate. 0 with *out set; SS_ENOTAVAIL with why filled and
 * *not_found set when the file was simply absent; SS_ENOMEM. */
static int try_one(const ss_dl_spec *spec, const char *cand,
                   const ss_dl_lib **out, text *why, int *not_found)
{
    void *h, *p;
    ss_dl_lib *lib = NULL;
    const ss_dl_lib *l;
    char file[SS_DL_PATH_MAX];
    char check_why[256];
    const char *arrow, *shown;
    size_t i, missing = 0;
    int rc = SS_ENOTAVAIL;

    *not_found = 0;
    (void)dlerror();
    h = dlopen(cand, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        const char *e = open_error(cand, dlerror());
        *not_found = strcmp(e, "not found") == 0;
        if (*not_found)
            text_add(why, "%s", cand);
        else
            text_add(why, "%s (%s)", cand, e);
        goto out;
    }
    for (l = registry; l != NULL; l = l->next) {
        if (l->handle == h && l->spec == (const void *)spec) {
            *out = l; /* out: drops the reference this dlopen took */
            rc = 0;
            goto out;
        }
    }
    loaded_path(h, cand, file, sizeof file);
    /* Name the file behind a soname or symlink too. */
    arrow = strcmp(cand, file) != 0 ? " => " : "";
    shown = strcmp(cand, file) != 0 ? file : "";
    lib = calloc(1, spec->table_size);
    if (lib == NULL) {
        rc = SS_ENOMEM;
        goto out;
    }
    for (i = 0; i < spec->nsyms; i++) {
        p = dlsym(h, spec->syms[i].name);
        /* POSIX guarantees a data pointer from dlsym converts to a function
         * pointer; the member is a function pointer of the same size. A
         * missing symbol leaves the member NULL (calloc). */
        memcpy((char *)lib + spec->syms[i].offset, &p, sizeof p);
        missing += p == NULL;
    }
    if (missing > 0) {
        text_add(why, "%s%s%s (missing symbol%s", cand, arrow, shown,
                 missing > 1 ? "s" : "");
        for (i = 0, missing = 0; i < spec->nsyms; i++) {
            memcpy(&p, (char *)lib + spec->syms[i].offset, sizeof p);
            if (p == NULL)
                text_add(why, "%s%s", missing++ == 0 ? " " : ", ",
                         spec->syms[i].name);
        }
        text_add(why, ")");
        rc = SS_ENOTAVAIL;
        goto out;
    }
    check_why[0] = '\0';
    if (spec->check != NULL) {
        rc = spec->check(lib, check_why, sizeof check_why);
        if (rc < 0) {
            text_add(why, "%s%s%s (%s)", cand, arrow, shown,
                     check_why[0] ? check_why : "rejected");
            goto out;
        }
    }
    memcpy(lib->path, file, sizeof lib->path);
    lib->handle = h;
    lib->spec = spec;
    lib->next = registry;
    registry = lib;
    *out = lib;
    lib = NULL;
    h = NULL; /* kept open for the life of the process */
    rc = 0;
out:
    free(lib);
    if (h != NULL)
        dlclose(h);
    return rc;
}

int ss_dl_load(const ss_dl_spec *spec, const char *const *cands, size_t n,
               const void **out, char *reason, size_t reason_len)
{
    char tried[SS_DL_REASON_MAX];
    text why = {tried, sizeof tried, 0};
    text msg = {reason, reason_len, 0};
    const ss_dl_lib *lib = NULL;
    size_t i, absent = 0;
    int rc = SS_ENOTAVAIL;

    *out = NULL;
    if (reason != NULL && reason_len > 0)
        reason[0] = '\0';
    tried[0] = '\0';
    if (cands == NULL) {
        cands = spec->defaults;
        n = spec->ndefaults;
    }
    if (n == 0) {
        text_add(&msg, "%s: no candidate library names given", spec->what);
        return SS_EINVAL;
    }
    pthread_mutex_lock(&registry_lock);
    for (i = 0; i < n; i++) {
        int not_found;
        if (cands[i] == NULL || cands[i][0] == '\0') {
            rc = SS_EINVAL;
            text_add(&msg, "%s: empty candidate library name", spec->what);
            goto out;
        }
        if (i > 0)
            text_add(&why, ", ");
        rc = try_one(spec, cands[i], &lib, &why, &not_found);
        if (rc == 0 || rc == SS_ENOMEM)
            goto out;
        absent += not_found;
    }
    text_finish(&why);
    if (absent == n)
        text_add(&msg, "%s not found: tried %s", spec->what, tried);
    else
        text_add(&msg, "%s not usable: tried %s", spec->what, tried);
    rc = SS_ENOTAVAIL;
out:
    pthread_mutex_unlock(&registry_lock);
    text_finish(&msg);
    if (rc == 0)
        *out = lib;
    return rc;
}
