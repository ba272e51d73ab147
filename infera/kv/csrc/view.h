/* GpuView, the index's GPU view (infera/kv/index.py): router hash -> the set of targets holding it
 * (by bit; u64table.h's Holders: a set costs what its members need), and per target engine hash ->
 * router hash. memory_bytes() reports what the tables allocated. Its storage and bookkeeping are in view.c,
 * the prefix matches in view_match.c, event application in view_apply.c (decoded events) and
 * view_payload.c (a msgpack batch as it came off the wire). */
#ifndef INFERA_VIEW_H
#define INFERA_VIEW_H

#include "ids.h"
#include "u64table.h"

/* ------------------------------------------------------------------------------------------ */
/* GpuView                                                                                     */

/* Counters of one apply() or apply_payload() call. */
typedef struct {
    Py_ssize_t stored_events, stored_blocks, removed_events, removed_blocks;
    Py_ssize_t dropped_events, skipped_events, misaligned_events, other_block_size;
} ApplyCounts;

/* The event counters a target's applies accumulate (TargetStats' fields of the same names). */
enum { C_STORED_EVENTS, C_STORED_BLOCKS, C_REMOVED_EVENTS, C_REMOVED_BLOCKS, C_DROPPED, C_SKIPPED, C_MISALIGNED,
       C_EVICTED, N_COUNTERS };

typedef struct {
    Map64 emap;         /* engine hash (folded to u64) -> its router hash's low 32 bits (view_emap.c) */
    Map64 ehigh;        /* engine hash -> the high 32 bits, where the low ones are ambiguous (rare) */
    Map64 tomb;         /* keys evicted since the last sweep: low 32 bits -> high (view_emap.c; bound only) */
    Py_ssize_t count;   /* router hashes whose entry has this target's bit */
    int unmapped;       /* the view may hold router hashes no emap value names */
    int live;
    Py_ssize_t counters[N_COUNTERS];
} Target;

/* The byte bound (GpuView.set_bound; infera/kv/bound.py has the model and its costs): bytes held =
 * block * blocks + holder * (members - blocks) + entry * members, where members are the (block,
 * target) entries; past max_bytes the coldest blocks go (view.c). */
typedef struct {
    uint64_t max_bytes; /* 0: unbounded */
    uint64_t block, holder, entry;
    uint64_t evicted_entries, evicted_blocks, rounds;
} Bound;

typedef struct {
    PyObject_HEAD
    Holders holders;
    Arena arena; /* GpuView(shared_bytes=N): the holder table lives here, read by other processes */
    Target *targets; /* by bit */
    Py_ssize_t ntargets;
    Py_ssize_t members; /* the targets' counts, summed: (block, target) entries */
    Bound bound;
    PyObject *stored_type, *removed_type, *cleared_type, *full_kinds;
} GpuView;

/* An engine hash as a u64 key: an int as its 64-bit two's complement (engines send unsigned or
 * signed 64-bit ints, one kind each), anything else (vLLM's bytes digests) folded with a seeded
 * XXH3, as vLLM itself folds a digest to 64 bits for its int hashes. */
#define FOLD_SEED_BYTES 0x6b76766965775f62ULL
#define FOLD_SEED_OTHER 0x6b76766965775f6fULL

INFERA_INTERNAL int infera_engine_key(PyObject *obj, uint64_t *out); /* view_apply.c */

/* The router hash that engine hash ``ekey`` names in target ``bit`` (view_emap.c): 1 with *out set;
 * 0 when mapped but the target no longer holds it (evicted); -1 when not mapped. */
INFERA_INTERNAL int infera_view_resolve(const GpuView *v, const Target *t, int bit, uint64_t ekey, uint64_t *out);
/* The holder slot of the key the target's map entry at ``i`` names, where the target holds it. */
INFERA_INTERNAL uint64_t *infera_view_slot_at(const GpuView *v, const Target *t, int bit, uint64_t i);
/* A removal: the map entry goes, and the target leaves the key it named (its count follows): 1 when
 * it held it, 0 when mapped but not held, -1 when not mapped. */
INFERA_INTERNAL int infera_view_unmap(GpuView *v, Target *t, int bit, uint64_t ekey);
/* After an eviction round: a map that names many keys the target no longer holds loses them. */
INFERA_INTERNAL void infera_view_sweep_map(GpuView *v, int bit);
/* Target ``bit`` holds router hash ``h`` (its count follows), mapped from ``ekey`` when ``mapped``. */
INFERA_INTERNAL int infera_view_store(GpuView *v, int bit, uint64_t h, int mapped, uint64_t ekey);

/* The bit ``obj`` names, of a live target (else KeyError). */
INFERA_INTERNAL int infera_view_parse_bit(GpuView *v, PyObject *obj, int *bit); /* view.c */
/* A call's counts added to the target's counters. */
INFERA_INTERNAL void infera_view_add_counts(Target *t, const ApplyCounts *c); /* view_apply.c */

/* The bytes the view holds by the bound's model (0 costs: 0). */
static inline uint64_t
view_bound_bytes(const GpuView *v)
{
    uint64_t blocks = v->holders.n, members = (uint64_t)v->members;
    uint64_t extra = members > blocks ? members - blocks : 0;
    return v->bound.block * blocks + v->bound.holder * extra + v->bound.entry * members;
}

/* Past the bound (if set): evict the coldest blocks (view.c). */
INFERA_INTERNAL void infera_view_trim(GpuView *v);

/* What a match walk reads a view through (view_match.c): whether a bit may be a target, a key's
 * holder set (1, with *set relative to ``base``; 0: no holder; -1: unreadable, the walk gives up),
 * and an optional prefetch of a key's slot. */
typedef struct {
    void *ctx;
    uint64_t base;
    int (*bit_ok)(void *ctx, uint32_t bit);
    int (*lookup)(void *ctx, uint64_t key, uint64_t *set);
    void (*prefetch)(void *ctx, uint64_t key);
} MatchSource;

INFERA_INTERNAL PyObject *infera_match_walk(const MatchSource *src, PyObject *hashes, PyObject *bits);
/* first_unheld(hashes, start=0)'s arguments, for a GpuView and a GpuViewReader alike: the hashes
 * (the caller releases them) and start >= 0; -1 with an exception. */
INFERA_INTERNAL int infera_first_unheld_args(PyObject *args, Hashes *hs, Py_ssize_t *start);

/* GpuView's methods defined outside view.c (its method table is there). */
INFERA_INTERNAL PyObject *infera_GpuView_first_unheld(GpuView *v, PyObject *args); /* view_match.c */
INFERA_INTERNAL PyObject *infera_GpuView_match_one(GpuView *v, PyObject *args);    /* view_match.c */
INFERA_INTERNAL PyObject *infera_GpuView_match(GpuView *v, PyObject *args);        /* view_match.c */
INFERA_INTERNAL PyObject *infera_GpuView_apply(GpuView *v, PyObject *args);        /* view_apply.c */
INFERA_INTERNAL PyObject *infera_GpuView_apply_payload(GpuView *v, PyObject *args); /* view_payload.c */

/* The bytes one block is hashed from (8 + 4 * block_size): on the stack up to 64-token blocks. */
typedef struct {
    unsigned char stack[8 + 4 * 64];
    unsigned char *heap;
    Py_ssize_t heap_len;
} Scratch;

static inline unsigned char *
scratch_get(Scratch *s, Py_ssize_t need)
{
    if (need <= (Py_ssize_t)sizeof(s->stack))
        return s->stack;
    if (need > s->heap_len) {
        unsigned char *b = PyMem_Realloc(s->heap, (size_t)need);
        if (b == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        s->heap = b;
        s->heap_len = need;
    }
    return s->heap;
}

#endif
