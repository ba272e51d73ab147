/* Open-addressing tables of u64 keys (linear probing, backward-shift deletion): Map64 (u64 -> u32)
 * and Holders (router hash -> the set of targets holding it). The probes and the set reads are
 * inline here (the walks call them per block); growth, deletion and the set writes are in
 * u64table.c. In C because a walk over a prompt's blocks then touches a few cache lines, not a dict
 * entry and two int objects per block.
 *
 * Sized for a fleet (issue 30): capacities are any integer (a key's home is the high half of its
 * mixed hash times the capacity), filled to 85% and grown by a quarter, so a table is never below
 * 68% full after it grows and the bytes per entry stay within a narrow band; and a holder set costs
 * what its members need (a few ids in the slot itself, a sorted array of ids, a bitmap only when
 * the holders are many), never a bit per target of the fleet. */
#ifndef INFERA_U64TABLE_H
#define INFERA_U64TABLE_H

#include "arena.h"

/* ------------------------------------------------------------------------------------------ */
/* open-addressing tables of u64 keys (linear probing, backward-shift deletion)                */

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define TABLE_MIN_CAP 16

/* A key's home slot in a table of ``cap`` slots (any cap > 0). */
static inline uint64_t
home_of(uint64_t key, uint64_t cap)
{
    return (uint64_t)(((unsigned __int128)(key * GOLDEN) * cap) >> 64);
}

/* Full past 85%: grow by a quarter (the load stays between 68% and 85%). */
static inline int
table_full(uint64_t n, uint64_t cap)
{
    return (n + 1) * 20 > cap * 17;
}

static inline uint64_t
table_grown(uint64_t cap)
{
    return cap < TABLE_MIN_CAP ? TABLE_MIN_CAP : cap + cap / 4;
}

static inline uint64_t
next_slot(uint64_t i, uint64_t cap)
{
    return ++i == cap ? 0 : i;
}

/* Whether the element at ``j``, whose home is ``k``, stays when the slot at ``i`` is emptied (its
 * home lies cyclically in (i, j]). */
static inline int
stays_put(uint64_t i, uint64_t j, uint64_t k)
{
    return (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
}

/* A table's storage is one block (a map's keys, values and used bits; the holders' slots and ages):
 * from PyMem while small, mapped from the OS past TMEM_MAP_MIN bytes. A table grows by a quarter at
 * a time, so at fleet size the heap was left with the holes of every size a table passed through
 * (~9 B per entry at 1,000 engines, issue 30); a mapping gives its pages back whole when the table
 * moves on. Zeroed. */
#define TMEM_MAP_MIN (32 * 1024)
INFERA_INTERNAL void *infera_tmem_alloc(size_t bytes);
INFERA_INTERNAL void infera_tmem_free(void *p, size_t bytes);

/* u64 key -> u32 value; the bit of used[] marks the occupied slots (any key, 0 included, is valid).
 * 32-bit values: a view's engine-hash map holds the low half of a router hash (view.h), the
 * counters and claims small counts and slot numbers. */
typedef struct {
    uint64_t *keys;
    uint32_t *vals;
    uint64_t *used; /* a bit per slot */
    uint64_t cap;   /* 0 or >= TABLE_MIN_CAP */
    uint64_t n;
} Map64;

static inline int
map_used(const Map64 *m, uint64_t i)
{
    return (int)((m->used[i >> 6] >> (i & 63)) & 1);
}

/* The bytes of a map's block: keys, the used bits, then the values. */
static inline size_t
map_block_bytes(uint64_t cap)
{
    return (size_t)(cap * 12 + ((cap + 63) / 64) * 8);
}

static inline void
map_free(Map64 *m)
{
    if (m->keys != NULL)
        infera_tmem_free(m->keys, map_block_bytes(m->cap));
    memset(m, 0, sizeof(*m));
}

/* The bytes the map has allocated. */
static inline uint64_t
map_bytes(const Map64 *m)
{
    return m->cap ? map_block_bytes(m->cap) : 0;
}

static inline int64_t
map_find(const Map64 *m, uint64_t key)
{
    if (m->cap == 0)
        return -1;
    uint64_t i = home_of(key, m->cap);
    while (map_used(m, i)) {
        if (m->keys[i] == key)
            return (int64_t)i;
        i = next_slot(i, m->cap);
    }
    return -1;
}

/* insert or overwrite */
INFERA_INTERNAL int infera_map_put(Map64 *m, uint64_t key, uint32_t val);
INFERA_INTERNAL void infera_map_delete_at(Map64 *m, uint64_t i);

static inline int
map_pop(Map64 *m, uint64_t key, uint32_t *val)
{
    int64_t i = map_find(m, key);
    if (i < 0)
        return 0;
    *val = m->vals[i];
    infera_map_delete_at(m, (uint64_t)i);
    return 1;
}

/* ------------------------------------------------------------------------------------------ */
/* Holders: router hash -> the set of targets (by id, the view's "bit") holding it              */

/* A slot is two words, the key and its holder set; the set's word is 0 in an empty slot (a key
 * whose last holder leaves is deleted). The set word is one of:
 *   - an inline bitmap (HS_BITMAP set, HS_EXT clear): the ids, all below HS_SMALL, as bits 0..61;
 *     the form of every set whose ids are all that small (a fleet of up to 62 targets never leaves
 *     it: one word per block, as a bitmask);
 *   - an inline list (neither set): 1 to HS_INLINE ids, ascending, HS_IDBITS bits each from the
 *     low bits, their number in bits 60..61 (ids are < HS_MAX_IDS, as GpuView.add allows);
 *   - HS_EXT set: a pointer (the low 62 bits) to an external set, an HArr (the ids, sorted) or,
 *     with HS_BITMAP set too, an HBits (a bit per id up to the highest held).
 * Past the inline forms a set is an array while its ids take less room than a bitmap of its highest
 * id would: a block held by one target among 1,000 costs its slot, one held by all of them a slot
 * and 1,000 bits. */
#define HS_EXT (1ULL << 63)
#define HS_BITMAP (1ULL << 62)
#define HS_PTR_MASK (HS_BITMAP - 1)
#define HS_SMALL 62
#define HS_SMALL_MASK ((1ULL << HS_SMALL) - 1)
#define HS_IDBITS 20
#define HS_IDMASK ((1ULL << HS_IDBITS) - 1)
#define HS_COUNT_SHIFT 60
#define HS_INLINE 3
#define HS_MAX_IDS (1 << HS_IDBITS)

typedef struct {
    uint32_t n, cap;
    uint32_t ids[];
} HArr;

typedef struct {
    uint32_t n, words;
    uint64_t bits[];
} HBits;

/* Ages, for a view bounded in bytes (GpuView.set_bound; ``aging`` set): a byte per slot, the epoch
 * of the key's last store or match. The epoch advances (infera_h_tick, once per batch or match) after
 * max(64, n / 64) touches, so the content churns over ~64 epochs; each advance also clamps the ages
 * of a 1/64th of the slots to at most HS_AGE_OLD epochs back (the whole table every 64 advances), so
 * a byte never wraps and "older than HS_AGE_OLD" is one bucket, as in the Python twin. */
#define HS_AGE_OLD 96

typedef struct {
    uint64_t *slots; /* cap * 2 words: key, holder set; then the cap age bytes (one block) */
    uint64_t cap;    /* >= TABLE_MIN_CAP once allocated */
    uint64_t n;
    uint64_t ext_bytes; /* bytes of the external sets */
    uint8_t *age;       /* cap bytes: the epoch of each slot's key's last touch (aging only) */
    uint64_t touches;   /* since the epoch last advanced */
    uint64_t clamp_at;  /* the next slot the clamp visits */
    uint8_t epoch;
    uint8_t aging;      /* 1: stores and matches stamp ages (a byte bound is set) */
    /* Shared (issue 30 item 4): the slots and the external sets live in ``arena``, which other
     * processes read (view_reader.c); every change is inside the arena's seqlock and a new table is
     * published in its header. NULL: private memory. */
    Arena *arena;
    uint64_t base; /* what an external set's word is relative to: 0 (a pointer), or the arena's address */
    /* Shared: a sequence per stripe of H_STRIPE slots (after the age bytes), odd while a change is
     * made to a slot of the stripe or to the set it holds; a reader checks only the stripes it read
     * (view_reader.c), so a change elsewhere in the table costs it nothing. The stripes one change
     * has marked (more than H_MARKS: the arena's whole-table sequence is held instead). */
    uint64_t *stripes;
    uint32_t marked[8];
    uint32_t nmarked;
    uint8_t whole; /* this change holds the arena's sequence */
} Holders;

#define H_STRIPE_SHIFT 6
#define H_MARKS 8

/* A shared table's stripes: their number, and where they start in the table's block (past the
 * slots and the age bytes). */
static inline uint64_t
h_nstripes(uint64_t cap)
{
    return (cap >> H_STRIPE_SHIFT) + 1;
}

static inline uint64_t
h_stripes_at(uint64_t cap)
{
    return (cap * 17 + 7) & ~7ULL;
}

static inline HArr *
hs_arr(uint64_t base, uint64_t v)
{
    return (HArr *)(uintptr_t)(base + (v & HS_PTR_MASK));
}

static inline HBits *
hs_bits(uint64_t base, uint64_t v)
{
    return (HBits *)(uintptr_t)(base + (v & HS_PTR_MASK));
}

static inline uint64_t
harr_bytes(uint32_t cap)
{
    return sizeof(HArr) + (uint64_t)cap * 4;
}

static inline uint64_t
hbits_bytes(uint32_t words)
{
    return sizeof(HBits) + (uint64_t)words * 8;
}

/* The number of ids in a (non-empty) set. */
static inline uint32_t
hs_count(uint64_t base, uint64_t v)
{
    if (v & HS_EXT)
        return (v & HS_BITMAP) ? hs_bits(base, v)->n : hs_arr(base, v)->n;
    if (v & HS_BITMAP)
        return (uint32_t)__builtin_popcountll(v & HS_SMALL_MASK);
    return (uint32_t)(v >> HS_COUNT_SHIFT);
}

/* The ids of an inline list, ascending, into out[HS_INLINE]; their number. */
static inline uint32_t
hs_list_ids(uint64_t v, uint32_t *out)
{
    uint32_t n = (uint32_t)(v >> HS_COUNT_SHIFT);
    for (uint32_t f = 0; f < n; f++)
        out[f] = (uint32_t)((v >> (f * HS_IDBITS)) & HS_IDMASK);
    return n;
}

/* The position of ``id`` in the sorted array, or where it would go (the first id >= it). */
static inline uint32_t
harr_lower_bound(const HArr *a, uint32_t id)
{
    uint32_t lo = 0, hi = a->n;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (a->ids[mid] < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static inline int
harr_has(const HArr *a, uint32_t id)
{
    uint32_t lo = harr_lower_bound(a, id);
    return lo < a->n && a->ids[lo] == id;
}

static inline int
hs_has(uint64_t base, uint64_t v, uint32_t id)
{
    if (!(v & HS_EXT)) {
        if (v & HS_BITMAP)
            return id < HS_SMALL && ((v >> id) & 1);
        uint32_t n = (uint32_t)(v >> HS_COUNT_SHIFT);
        for (uint32_t f = 0; f < n; f++) {
            if (((v >> (f * HS_IDBITS)) & HS_IDMASK) == id)
                return 1;
        }
        return 0;
    }
    if (v & HS_BITMAP) {
        const HBits *b = hs_bits(base, v);
        return (id >> 6) < b->words && ((b->bits[id >> 6] >> (id & 63)) & 1);
    }
    return harr_has(hs_arr(base, v), id);
}

/* A router hash's home slot: from its low 32 bits only, so that a view's engine-hash map, which
 * keeps those 32 bits of each router hash (view.h), finds the whole key among the few that share
 * its home. */
static inline uint64_t
h_home(uint64_t key, uint64_t cap)
{
    return home_of(key & 0xFFFFFFFFULL, cap);
}

/* the slot of ``key``, or NULL */
static inline uint64_t *
h_find(const Holders *h, uint64_t key)
{
    if (h->cap == 0)
        return NULL;
    uint64_t i = h_home(key, h->cap);
    for (;;) {
        uint64_t *slot = h->slots + 2 * i;
        if (slot[0] == key && slot[1] != 0)
            return slot;
        if (slot[1] == 0)
            return NULL;
        i = next_slot(i, h->cap);
    }
}

/* Start loading the home slot of ``key`` (a walk asks for it a few blocks ahead: the loads of
 * several blocks then overlap instead of missing the cache one after another). */
static inline void
h_prefetch(const Holders *h, uint64_t key)
{
    if (h->cap)
        __builtin_prefetch(h->slots + 2 * h_home(key, h->cap));
}

/* A store or match of the key in ``slot``: its age is the current epoch. */
static inline void
h_touch(Holders *h, const uint64_t *slot)
{
    if (h->aging) {
        h->age[(uint64_t)(slot - h->slots) >> 1] = h->epoch;
        h->touches++;
    }
}

/* The key's age in epochs, HS_AGE_OLD at most (the eviction's buckets). */
static inline uint32_t
h_age_of(const Holders *h, uint64_t i)
{
    uint32_t d = (uint8_t)(h->epoch - h->age[i]);
    return d > HS_AGE_OLD ? HS_AGE_OLD : d;
}

/* The keys ``id`` holds whose low 32 bits are ``low`` (but ``except``, when ``skip``): how many (0, 1,
 * or 2 meaning two or more), the first one's slot in *out. They all lie in the run of slots from
 * their home. */
static inline int
h_held_low(const Holders *h, uint32_t low, uint32_t id, int skip, uint64_t except, uint64_t **out)
{
    if (h->cap == 0)
        return 0;
    int found = 0;
    for (uint64_t i = h_home(low, h->cap);; i = next_slot(i, h->cap)) {
        uint64_t *slot = h->slots + 2 * i;
        if (slot[1] == 0)
            return found;
        if ((uint32_t)slot[0] == low && !(skip && slot[0] == except) && hs_has(h->base, slot[1], id)) {
            if (found++)
                return 2;
            *out = slot;
        }
    }
}

/* How many blocks ahead a walk prefetches. */
#define H_AHEAD 8

INFERA_INTERNAL int infera_h_alloc(Holders *h, uint64_t cap);
/* An empty table of ``cap`` slots in ``arena``, published there for its readers: from now on every
 * change is made inside the arena's seqlock. */
INFERA_INTERNAL int infera_h_share(Holders *h, Arena *arena, uint64_t cap);
INFERA_INTERNAL void infera_h_free(Holders *h);
/* 1: ``id`` newly joins the set of ``key`` (entered if absent); 0: it was in it; -1: no memory */
INFERA_INTERNAL int infera_h_add(Holders *h, uint64_t key, uint32_t id);
/* Remove ``id`` from the set in ``slot``: 1 if it was there (the entry goes with its last id, and
 * the slot may then hold another key), 0 if not. */
INFERA_INTERNAL int infera_h_remove_at(Holders *h, uint64_t *slot, uint32_t id);
/* Evict the key in ``slot`` with its whole set: ``each(ctx, id)`` for every id first. */
INFERA_INTERNAL void infera_h_evict_at(Holders *h, uint64_t *slot, void (*each)(void *, uint32_t), void *ctx);
/* Once per batch or match of a bounded view: advance the epoch after enough touches (see Holders). */
INFERA_INTERNAL void infera_h_tick(Holders *h);

/* 1: ``id`` was in the set of ``key`` and is removed; 0: it was not */
static inline int
h_remove(Holders *h, uint64_t key, uint32_t id)
{
    uint64_t *slot = h_find(h, key);
    return slot != NULL && infera_h_remove_at(h, slot, id);
}

static inline int
h_has(const Holders *h, uint64_t key, uint32_t id)
{
    uint64_t *slot = h_find(h, key);
    return slot != NULL && hs_has(h->base, slot[1], id);
}

static inline uint64_t
h_bytes(const Holders *h)
{
    return h->cap * 17 + h->ext_bytes; /* the slots and their age bytes */
}

#endif
