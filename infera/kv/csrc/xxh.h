/* XXH3 from the xxhash package's own compiled library, found with dlsym at import (xxh.c): every
 * hash is the one infera's Python code computes with the same package. */
#ifndef INFERA_XXH_H
#define INFERA_XXH_H

#include "native.h"

typedef struct { uint64_t low64, high64; } xxh128_t;
typedef uint64_t (*xxh3_64_fn)(const void *, size_t);
typedef uint64_t (*xxh3_64_seed_fn)(const void *, size_t, uint64_t);
typedef void *(*xxh3_create_fn)(void);
typedef int (*xxh3_reset_fn)(void *);
typedef int (*xxh3_update_fn)(void *, const void *, size_t);
typedef xxh128_t (*xxh3_digest128_fn)(const void *);

INFERA_INTERNAL extern xxh3_64_fn infera_xxh3_64;
INFERA_INTERNAL extern xxh3_64_seed_fn infera_xxh3_64_seed;
INFERA_INTERNAL extern xxh3_reset_fn infera_xxh3_128_reset;
INFERA_INTERNAL extern xxh3_update_fn infera_xxh3_128_update;
INFERA_INTERNAL extern xxh3_digest128_fn infera_xxh3_128_digest;

/* Two streaming states made once (a state is ~600 bytes, aligned: malloc'd per call it cost more than
 * hashing a short prompt). Every user holds the GIL and none calls back into Python while using one. */
INFERA_INTERNAL extern void *infera_xxh_state, *infera_xxh_state_whole;

#endif
