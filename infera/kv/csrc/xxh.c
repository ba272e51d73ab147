/* xxHash, from the xxhash package's library: its extension module exports the XXH3_* symbols,
 * looked up here with dlsym once at import (in C because the hot loops of the other files call
 * them per block, with no Python object in between). When they cannot be found the import fails
 * and the Python implementations run instead (infera/kv/native.py). */
#include <dlfcn.h>

#include "xxh.h"

/* ------------------------------------------------------------------------------------------ */
/* xxHash, from the xxhash package's library                                                   */

xxh3_64_fn infera_xxh3_64;
xxh3_64_seed_fn infera_xxh3_64_seed;
static xxh3_create_fn XXH3_create;
xxh3_reset_fn infera_xxh3_128_reset;
xxh3_update_fn infera_xxh3_128_update;
xxh3_digest128_fn infera_xxh3_128_digest;
void *infera_xxh_state, *infera_xxh_state_whole;

int
infera_load_xxhash(void)
{
    PyObject *mod = PyImport_ImportModule("xxhash._xxhash");
    if (mod == NULL)
        return -1;
    PyObject *file = PyObject_GetAttrString(mod, "__file__");
    Py_DECREF(mod);
    if (file == NULL)
        return -1;
    const char *path = PyUnicode_AsUTF8(file);
    if (path == NULL) {
        Py_DECREF(file);
        return -1;
    }
    /* already loaded by the import above: this only finds its handle */
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    Py_DECREF(file);
    if (lib == NULL) {
        PyErr_Format(PyExc_ImportError, "cannot find xxhash's library: %s", dlerror());
        return -1;
    }
#define SYM(var, type, name)                                                                         \
    var = (type)dlsym(lib, name);                                                                    \
    if (var == NULL) {                                                                               \
        PyErr_SetString(PyExc_ImportError, "xxhash's library does not export " name);                \
        return -1;                                                                                   \
    }
    SYM(infera_xxh3_64, xxh3_64_fn, "XXH3_64bits");
    SYM(infera_xxh3_64_seed, xxh3_64_seed_fn, "XXH3_64bits_withSeed");
    SYM(XXH3_create, xxh3_create_fn, "XXH3_createState");
    SYM(infera_xxh3_128_reset, xxh3_reset_fn, "XXH3_128bits_reset");
    SYM(infera_xxh3_128_update, xxh3_update_fn, "XXH3_128bits_update");
    SYM(infera_xxh3_128_digest, xxh3_digest128_fn, "XXH3_128bits_digest");
#undef SYM
    infera_xxh_state = XXH3_create();
    infera_xxh_state_whole = XXH3_create();
    if (infera_xxh_state == NULL || infera_xxh_state_whole == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}
