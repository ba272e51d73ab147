/* Open-addressing tables of u64 keys (linear probing, backward-shift deletion): Map64 (u64 -> u64)
 * and Holders (router hash -> holder bits). The probes and the bit operations are inline here (the
 * walks call them per block); growth and deletion are in u64table.c. In C because a walk over a
 * prompt's blocks then touches a few cache lines, not a dict entry and two int objects per block. */
#ifndef INFERA_U64TABLE_H
#define INFERA_U64TABLE_H

#include "native.h"

/* ------------------------------------------------------------------------------------------ */
/* open-addressing tables of u64 keys (linear probing, backward-shift deletion)                */

#define GOLDEN 0x9E3779B97F4A7C15ULL

static inline uint64_t
home_of(uint64_t key, int shift)
{
    return (key * GOLDEN) >> shift;
}

/* key -> u64 value; used[] marks the occupied slots (any key, 0 included, is valid) */
typedef struct {
    uint64_t *keys;
    uint64_t *vals;
    uint8_t *used;
    uint64_t cap; /* 0 or a power of two */
    uint64_t n;
    int shift;
} Map64;

static inline void
map_free(Map64 *m)
{
    PyMem_Free(m->keys);
    PyMem_Free(m->vals);
    PyMem_Free(m->used);
    memset(m, 0, sizeof(*m));
}

static inline int64_t
map_find(const Map64 *m, uint64_t key)
{
    if (m->cap == 0)
        return -1;
    uint64_t mask = m->cap - 1;
    uint64_t i = home_of(key, m->shift);
    while (m->used[i]) {
        if (m->keys[i] == key)
            return (int64_t)i;
        i = (i + 1) & mask;
    }
    return -1;
}

/* insert or overwrite */
INFERA_INTERNAL int infera_map_put(Map64 *m, uint64_t key, uint64_t val);
INFERA_INTERNAL void infera_map_delete_at(Map64 *m, uint64_t i);

static inline int
map_pop(Map64 *m, uint64_t key, uint64_t *val)
{
    int64_t i = map_find(m, key);
    if (i < 0)
        return 0;
    *val = m->vals[i];
    infera_map_delete_at(m, (uint64_t)i);
    return 1;
}

/* router hash -> holder bits (``words`` u64 words per entry); an entry with no bit is no entry */
typedef struct {
    uint64_t *slots; /* cap * (1 + words): key, then the bit words */
    uint64_t cap;
    uint64_t n;
    int shift;
    int words;
} Holders;

#define H_STRIDE(h) ((uint64_t)(1 + (h)->words))

static inline int
h_empty(const Holders *h, const uint64_t *slot)
{
    for (int w = 1; w <= h->words; w++) {
        if (slot[w])
            return 0;
    }
    return 1;
}

static inline int
h_alloc(Holders *h, uint64_t cap, int words)
{
    int bits = 0;
    while ((1ULL << bits) < cap)
        bits++;
    h->slots = PyMem_Calloc(cap * (uint64_t)(1 + words), sizeof(uint64_t));
    if (h->slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    h->cap = cap;
    h->n = 0;
    h->shift = 64 - bits;
    h->words = words;
    return 0;
}

/* the slot of ``key``, or NULL */
static inline uint64_t *
h_find(const Holders *h, uint64_t key)
{
    uint64_t mask = h->cap - 1, stride = H_STRIDE(h);
    uint64_t i = home_of(key, h->shift);
    for (;;) {
        uint64_t *slot = h->slots + i * stride;
        if (h_empty(h, slot))
            return NULL;
        if (slot[0] == key)
            return slot;
        i = (i + 1) & mask;
    }
}

INFERA_INTERNAL int infera_h_rebuild(Holders *h, uint64_t cap, int words);
INFERA_INTERNAL void infera_h_delete(Holders *h, uint64_t *slot);

/* the slot of ``key``, inserted empty if absent (the caller sets a bit at once) */
static inline uint64_t *
h_slot_for(Holders *h, uint64_t key)
{
    if ((h->n + 1) * 4 > h->cap * 3 && infera_h_rebuild(h, h->cap * 2, h->words) < 0)
        return NULL;
    uint64_t mask = h->cap - 1, stride = H_STRIDE(h);
    uint64_t i = home_of(key, h->shift);
    for (;;) {
        uint64_t *slot = h->slots + i * stride;
        if (h_empty(h, slot)) {
            slot[0] = key;
            h->n++;
            return slot;
        }
        if (slot[0] == key)
            return slot;
        i = (i + 1) & mask;
    }
}

/* 1: the bit was newly set; 0: it was set already; -1: out of memory */
static inline int
h_set_bit(Holders *h, uint64_t key, int bit)
{
    uint64_t *slot = h_slot_for(h, key);
    if (slot == NULL)
        return -1;
    uint64_t b = 1ULL << (bit & 63);
    uint64_t *word = slot + 1 + (bit >> 6);
    if (*word & b)
        return 0;
    *word |= b;
    return 1;
}

/* 1: the bit was set and is cleared (the entry goes with its last bit); 0: it was not set */
static inline int
h_clear_bit(Holders *h, uint64_t key, int bit)
{
    uint64_t *slot = h_find(h, key);
    if (slot == NULL)
        return 0;
    uint64_t b = 1ULL << (bit & 63);
    uint64_t *word = slot + 1 + (bit >> 6);
    if (!(*word & b))
        return 0;
    *word &= ~b;
    if (h_empty(h, slot))
        infera_h_delete(h, slot);
    return 1;
}

static inline int
h_has_bit(const Holders *h, uint64_t key, int bit)
{
    uint64_t *slot = h_find(h, key);
    return slot != NULL && (slot[1 + (bit >> 6)] >> (bit & 63)) & 1;
}

#endif
