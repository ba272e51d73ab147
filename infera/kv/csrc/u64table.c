/* Growth and deletion of the open-addressing tables of u64 keys, and the holder sets' writes
 * (u64table.h has the probes and the reads). */
#include "u64table.h"

#include <sys/mman.h>

/* ------------------------------------------------------------------------------------------ */
/* Map64                                                                                       */

void *
infera_tmem_alloc(size_t bytes)
{
    if (bytes < TMEM_MAP_MIN)
        return PyMem_Calloc(1, bytes);
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

void
infera_tmem_free(void *p, size_t bytes)
{
    if (bytes < TMEM_MAP_MIN)
        PyMem_Free(p);
    else
        munmap(p, bytes);
}

static int
map_alloc(Map64 *m, uint64_t cap)
{
    uint64_t *block = infera_tmem_alloc(map_block_bytes(cap));
    if (block == NULL) {
        memset(m, 0, sizeof(*m));
        PyErr_NoMemory();
        return -1;
    }
    m->keys = block;
    m->used = block + cap;
    m->vals = (uint32_t *)(m->used + (cap + 63) / 64);
    m->cap = cap;
    m->n = 0;
    return 0;
}

static int
map_grow(Map64 *m)
{
    Map64 old = *m;
    if (map_alloc(m, table_grown(old.cap)) < 0) {
        *m = old;
        return -1;
    }
    for (uint64_t i = 0; i < old.cap; i++) {
        if (map_used(&old, i))
            infera_map_put(m, old.keys[i], old.vals[i]);
    }
    map_free(&old);
    return 0;
}

int
infera_map_put(Map64 *m, uint64_t key, uint32_t val)
{
    if (table_full(m->n, m->cap) && map_grow(m) < 0)
        return -1;
    uint64_t i = home_of(key, m->cap);
    while (map_used(m, i)) {
        if (m->keys[i] == key) {
            m->vals[i] = val;
            return 0;
        }
        i = next_slot(i, m->cap);
    }
    m->used[i >> 6] |= 1ULL << (i & 63);
    m->keys[i] = key;
    m->vals[i] = val;
    m->n++;
    return 0;
}

void
infera_map_delete_at(Map64 *m, uint64_t i)
{
    uint64_t j = i;
    for (;;) {
        j = next_slot(j, m->cap);
        if (!map_used(m, j))
            break;
        /* move j back to the hole at i unless its home lies cyclically in (i, j] */
        if (!stays_put(i, j, home_of(m->keys[j], m->cap))) {
            m->keys[i] = m->keys[j];
            m->vals[i] = m->vals[j];
            i = j;
        }
    }
    m->used[i >> 6] &= ~(1ULL << (i & 63));
    m->n--;
}

/* ------------------------------------------------------------------------------------------ */
/* Holders: the table                                                                          */

/* The holders' memory: private (PyMem, and tables through tmem), or the shared arena's. */
static void *
hmem_alloc(Holders *h, size_t bytes)
{
    if (h->arena == NULL)
        return PyMem_Calloc(1, bytes);
    uint64_t at = infera_arena_alloc(h->arena, bytes);
    return at ? h->arena->base + at : NULL;
}

static void
hmem_free(Holders *h, void *p, size_t bytes)
{
    if (h->arena == NULL)
        PyMem_Free(p);
    else if (p != NULL)
        infera_arena_free(h->arena, (uint64_t)((uint8_t *)p - h->arena->base), bytes);
}

/* ``p`` (``old`` bytes) moved to a block of ``bytes``; the bytes past ``old`` are not zeroed. */
static void *
hmem_realloc(Holders *h, void *p, size_t old, size_t bytes)
{
    if (h->arena == NULL)
        return PyMem_Realloc(p, bytes);
    void *g = hmem_alloc(h, bytes);
    if (g != NULL) {
        memcpy(g, p, old < bytes ? old : bytes);
        hmem_free(h, p, old);
    }
    return g;
}

/* A change a shared table's readers could see (no-ops when private): h_wbegin, then h_mark(i)
 * before the slot at i (or the set it holds) is written, then h_wend. */
static inline void
h_wbegin(Holders *h)
{
    h->nmarked = 0;
    h->whole = 0;
}

static void
h_mark(Holders *h, uint64_t i)
{
    if (h->arena == NULL || h->whole)
        return;
    uint32_t s = (uint32_t)(i >> H_STRIPE_SHIFT);
    for (uint32_t k = 0; k < h->nmarked; k++) {
        if (h->marked[k] == s)
            return;
    }
    if (h->nmarked == H_MARKS) { /* a long shift: the whole table's sequence instead */
        arena_write_begin(h->arena);
        h->whole = 1;
        return;
    }
    h->marked[h->nmarked++] = s;
    __atomic_store_n(&h->stripes[s], h->stripes[s] + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static inline void
h_mark_slot(Holders *h, const uint64_t *slot)
{
    if (h->arena != NULL)
        h_mark(h, (uint64_t)(slot - h->slots) / 2);
}

static inline void
h_wend(Holders *h)
{
    if (h->arena == NULL)
        return;
    for (uint32_t k = 0; k < h->nmarked; k++) {
        uint32_t s = h->marked[k];
        __atomic_store_n(&h->stripes[s], h->stripes[s] + 1, __ATOMIC_RELEASE);
    }
    h->nmarked = 0;
    if (h->whole) {
        arena_write_end(h->arena);
        h->whole = 0;
    }
}

/* The bytes of the holders' block: the slots, then an age byte per slot (shared: then the stripes'
 * sequences). */
static size_t
h_block_bytes(const Holders *h, uint64_t cap)
{
    if (h->arena != NULL)
        return (size_t)(h_stripes_at(cap) + h_nstripes(cap) * 8);
    return (size_t)(cap * 17);
}

static uint64_t *
h_block_alloc(Holders *h, uint64_t cap)
{
    if (h->arena == NULL)
        return infera_tmem_alloc(h_block_bytes(h, cap));
    return hmem_alloc(h, h_block_bytes(h, cap));
}

static void
h_block_free(Holders *h, uint64_t *slots, uint64_t cap)
{
    if (slots == NULL)
        return;
    if (h->arena == NULL)
        infera_tmem_free(slots, h_block_bytes(h, cap));
    else
        hmem_free(h, slots, h_block_bytes(h, cap));
}

/* A shared table's readers find its slots here from now on. */
static void
h_publish(Holders *h)
{
    if (h->arena == NULL)
        return;
    ArenaHeader *hd = arena_header(h->arena);
    arena_write_begin(h->arena);
    hd->slots = (uint64_t)((uint8_t *)h->slots - h->arena->base);
    hd->cap = h->cap;
    arena_write_end(h->arena);
}

int
infera_h_share(Holders *h, Arena *arena, uint64_t cap)
{
    if (h->slots != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a holder table is shared from its start only");
        return -1;
    }
    h->arena = arena;
    h->base = (uint64_t)(uintptr_t)arena->base;
    if (infera_h_alloc(h, cap) < 0)
        return -1;
    h_publish(h);
    return 0;
}

int
infera_h_alloc(Holders *h, uint64_t cap)
{
    h->slots = h_block_alloc(h, cap);
    if (h->slots == NULL) {
        h->age = NULL;
        PyErr_NoMemory();
        return -1;
    }
    h->age = (uint8_t *)(h->slots + 2 * cap);
    h->stripes = h->arena != NULL ? (uint64_t *)((uint8_t *)h->slots + h_stripes_at(cap)) : NULL;
    h->clamp_at = 0;
    h->cap = cap;
    h->n = 0;
    return 0;
}

static void
hs_free(Holders *h, uint64_t v)
{
    if (!(v & HS_EXT))
        return;
    if (v & HS_BITMAP) {
        HBits *b = hs_bits(h->base, v);
        h->ext_bytes -= hbits_bytes(b->words);
        hmem_free(h, b, hbits_bytes(b->words));
    }
    else {
        HArr *a = hs_arr(h->base, v);
        h->ext_bytes -= harr_bytes(a->cap);
        hmem_free(h, a, harr_bytes(a->cap));
    }
}

void
infera_h_free(Holders *h)
{
    if (h->arena != NULL && h->slots != NULL) { /* readers: no table from now on (nothing held) */
        ArenaHeader *hd = arena_header(h->arena);
        arena_write_begin(h->arena);
        hd->slots = 0;
        hd->cap = 0;
        arena_write_end(h->arena);
    }
    for (uint64_t i = 0; i < h->cap; i++)
        hs_free(h, h->slots[2 * i + 1]);
    h_block_free(h, h->slots, h->cap);
    Arena *arena = h->arena;
    uint64_t base = h->base;
    memset(h, 0, sizeof(*h));
    h->arena = arena; /* (the arena is the view's: it outlives the table) */
    h->base = base;
}

static int
h_rebuild(Holders *h, uint64_t cap)
{
    Holders old = *h;
    if (infera_h_alloc(h, cap) < 0) {
        *h = old;
        return -1;
    }
    h->ext_bytes = old.ext_bytes;
    for (uint64_t i = 0; i < old.cap; i++) {
        uint64_t *src = old.slots + 2 * i;
        if (src[1] == 0)
            continue;
        /* insert directly: the new table has room and no copy of the key */
        uint64_t j = h_home(src[0], h->cap);
        while (h->slots[2 * j + 1] != 0)
            j = next_slot(j, h->cap);
        h->slots[2 * j] = src[0];
        h->slots[2 * j + 1] = src[1];
        h->age[j] = old.age[i];
        h->n++;
    }
    /* readers go on reading the old table until the new one is published, and a reader that read
     * the old one's address sees the sequence move on: its read is taken again, from the new one */
    h_publish(h);
    h_block_free(h, old.slots, old.cap);
    return 0;
}

/* Empty the slot at ``slot`` (backward shift: the entries after it that may move back, do). */
static void
h_delete(Holders *h, uint64_t *slot)
{
    uint64_t i = (uint64_t)(slot - h->slots) / 2;
    uint64_t j = i;
    for (;;) {
        j = next_slot(j, h->cap);
        uint64_t *sj = h->slots + 2 * j;
        if (sj[1] == 0)
            break;
        if (!stays_put(i, j, h_home(sj[0], h->cap))) {
            h_mark(h, j); /* (i is marked: the slot emptied, or a j before) */
            h->slots[2 * i] = sj[0];
            h->slots[2 * i + 1] = sj[1];
            h->age[i] = h->age[j];
            i = j;
        }
    }
    h->slots[2 * i] = 0;
    h->slots[2 * i + 1] = 0;
    h->n--;
}

/* ------------------------------------------------------------------------------------------ */
/* Holders: the sets                                                                           */

/* The inline list of 1..HS_INLINE sorted ids. */
static uint64_t
hs_list(const uint32_t *ids, uint32_t n)
{
    uint64_t v = (uint64_t)n << HS_COUNT_SHIFT;
    for (uint32_t f = 0; f < n; f++)
        v |= (uint64_t)ids[f] << (f * HS_IDBITS);
    return v;
}

/* The inline bitmap of ids all below HS_SMALL. */
static uint64_t
hs_small(const uint32_t *ids, uint32_t n)
{
    uint64_t v = HS_BITMAP;
    for (uint32_t k = 0; k < n; k++)
        v |= 1ULL << ids[k];
    return v;
}

/* A bitmap of the highest id is smaller than an array of n ids. */
static int
prefer_bitmap(uint32_t n, uint32_t max_id)
{
    return (uint64_t)n > 2 * ((uint64_t)(max_id >> 6) + 1);
}

/* The tagged set word of an allocation, counted in ext_bytes. A user-space address leaves the two
 * tag bits clear on every 64-bit platform CPython runs on (x86-64 and arm64 use at most 57 bits). */
static uint64_t
hs_word(Holders *h, void *p, uint64_t bytes, uint64_t flags)
{
    uint64_t rel = (uint64_t)(uintptr_t)p - h->base; /* a shared table's sets: offsets in the arena */
    if (rel & ~HS_PTR_MASK)
        Py_FatalError("infera.kv._native: a holder set allocated above the 62-bit address space");
    h->ext_bytes += bytes;
    return rel | HS_EXT | flags;
}

/* The set word of the n >= 1 sorted ids in its smallest form: an inline bitmap, an inline list, an
 * array or a bitmap. 0, or -1 (no memory). */
static int
hs_make(Holders *h, const uint32_t *ids, uint32_t n, uint64_t *out)
{
    uint32_t max_id = ids[n - 1];
    if (max_id < HS_SMALL) {
        *out = hs_small(ids, n);
        return 0;
    }
    if (n <= HS_INLINE) {
        *out = hs_list(ids, n);
        return 0;
    }
    if (prefer_bitmap(n, max_id)) {
        uint32_t words = (max_id >> 6) + 1;
        HBits *b = hmem_alloc(h, hbits_bytes(words));
        if (b == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        b->n = n;
        b->words = words;
        for (uint32_t k = 0; k < n; k++)
            b->bits[ids[k] >> 6] |= 1ULL << (ids[k] & 63);
        *out = hs_word(h, b, hbits_bytes(words), HS_BITMAP);
        return 0;
    }
    uint32_t cap = n < 8 ? 8 : (n + 1) & ~1u;
    HArr *a = hmem_alloc(h, harr_bytes(cap));
    if (a == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    a->n = n;
    a->cap = cap;
    memcpy(a->ids, ids, (size_t)n * 4);
    *out = hs_word(h, a, harr_bytes(cap), 0);
    return 0;
}

/* The ids of an inline set (a bitmap or a list), ascending, into out[HS_SMALL]; their number. */
static uint32_t
hs_inline_ids(uint64_t v, uint32_t *out)
{
    if (!(v & HS_BITMAP))
        return hs_list_ids(v, out);
    uint32_t n = 0;
    for (uint64_t x = v & HS_SMALL_MASK; x; x &= x - 1)
        out[n++] = (uint32_t)__builtin_ctzll(x);
    return n;
}

/* Add ``id`` to the set in ``slot``: 1, 0 (was there), -1 (no memory; the set unchanged). */
static int
hs_add(Holders *h, uint64_t *slot, uint32_t id)
{
    uint64_t v = slot[1];
    if (!(v & HS_EXT)) {
        if ((v & HS_BITMAP) && id < HS_SMALL) {
            if ((v >> id) & 1)
                return 0;
            slot[1] = v | (1ULL << id);
            return 1;
        }
        uint32_t ids[HS_SMALL + 1];
        uint32_t n = hs_inline_ids(v, ids), at = 0;
        while (at < n && ids[at] < id)
            at++;
        if (at < n && ids[at] == id)
            return 0;
        memmove(ids + at + 1, ids + at, (size_t)(n - at) * 4);
        ids[at] = id;
        if (hs_make(h, ids, n + 1, &v) < 0)
            return -1;
        slot[1] = v;
        return 1;
    }
    if (v & HS_BITMAP) {
        HBits *b = hs_bits(h->base, v);
        uint32_t w = id >> 6;
        if (w >= b->words) {
            uint32_t words = w + 1;
            HBits *g = hmem_realloc(h, b, hbits_bytes(b->words), hbits_bytes(words));
            if (g == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            memset(g->bits + g->words, 0, (size_t)(words - g->words) * 8);
            h->ext_bytes -= hbits_bytes(g->words);
            g->words = words;
            slot[1] = hs_word(h, g, hbits_bytes(words), HS_BITMAP);
            b = g;
        }
        uint64_t bit = 1ULL << (id & 63);
        if (b->bits[w] & bit)
            return 0;
        b->bits[w] |= bit;
        b->n++;
        return 1;
    }
    HArr *a = hs_arr(h->base, v);
    uint32_t lo = harr_lower_bound(a, id);
    if (lo < a->n && a->ids[lo] == id)
        return 0;
    uint32_t max_id = a->ids[a->n - 1] > id ? a->ids[a->n - 1] : id;
    if (prefer_bitmap(a->n + 1, max_id)) {
        uint32_t words = (max_id >> 6) + 1;
        HBits *b = hmem_alloc(h, hbits_bytes(words));
        if (b == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        b->n = a->n + 1;
        b->words = words;
        for (uint32_t k = 0; k < a->n; k++)
            b->bits[a->ids[k] >> 6] |= 1ULL << (a->ids[k] & 63);
        b->bits[id >> 6] |= 1ULL << (id & 63);
        v = hs_word(h, b, hbits_bytes(words), HS_BITMAP);
        hs_free(h, slot[1]);
        slot[1] = v;
        return 1;
    }
    if (a->n == a->cap) {
        uint32_t cap = a->cap + (a->cap / 2 + 1) / 2 * 2;
        HArr *g = hmem_realloc(h, a, harr_bytes(a->cap), harr_bytes(cap));
        if (g == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        h->ext_bytes -= harr_bytes(g->cap);
        g->cap = cap;
        slot[1] = hs_word(h, g, harr_bytes(cap), 0);
        a = g;
    }
    memmove(a->ids + lo + 1, a->ids + lo, (size_t)(a->n - lo) * 4);
    a->ids[lo] = id;
    a->n++;
    return 1;
}

static int
h_add(Holders *h, uint64_t key, uint32_t id)
{
    uint64_t i = h_home(key, h->cap);
    for (;;) {
        uint64_t *slot = h->slots + 2 * i;
        if (slot[1] == 0) {
            h_mark(h, i);
            slot[0] = key;
            slot[1] = id < HS_SMALL ? hs_small(&id, 1) : hs_list(&id, 1);
            h->n++;
            h_touch(h, slot);
            return 1;
        }
        if (slot[0] == key) {
            h_touch(h, slot);
            h_mark(h, i);
            return hs_add(h, slot, id);
        }
        i = next_slot(i, h->cap);
    }
}

int
infera_h_add(Holders *h, uint64_t key, uint32_t id)
{
    if (h->cap == 0 || table_full(h->n, h->cap)) {
        if (h_rebuild(h, table_grown(h->cap)) < 0)
            return -1;
    }
    h_wbegin(h);
    int r = h_add(h, key, id);
    h_wend(h);
    return r;
}

/* The external set in ``slot`` (n ids, sorted in ``ids``) replaced by its smallest form, when that
 * is another (an inline one, or an array for a bitmap): best effort, kept as it is without memory. */
static void
hs_shrink(Holders *h, uint64_t *slot, const uint32_t *ids, uint32_t n)
{
    uint64_t nv;
    if (hs_make(h, ids, n, &nv) < 0) {
        PyErr_Clear();
        return;
    }
    hs_free(h, slot[1]);
    slot[1] = nv;
}

static int h_remove_at(Holders *h, uint64_t *slot, uint32_t id);

int
infera_h_remove_at(Holders *h, uint64_t *slot, uint32_t id)
{
    h_wbegin(h);
    h_mark_slot(h, slot);
    int r = h_remove_at(h, slot, id);
    h_wend(h);
    return r;
}

static int
h_remove_at(Holders *h, uint64_t *slot, uint32_t id)
{
    uint64_t v = slot[1];
    if (!(v & HS_EXT)) {
        if (v & HS_BITMAP) {
            if (id >= HS_SMALL || !((v >> id) & 1))
                return 0;
            v &= ~(1ULL << id);
            if (v == HS_BITMAP)
                h_delete(h, slot);
            else
                slot[1] = v;
            return 1;
        }
        uint32_t ids[HS_INLINE];
        uint32_t n = hs_list_ids(v, ids), at = 0;
        while (at < n && ids[at] != id)
            at++;
        if (at == n)
            return 0;
        if (n == 1) {
            h_delete(h, slot);
            return 1;
        }
        memmove(ids + at, ids + at + 1, (size_t)(n - at - 1) * 4);
        hs_make(h, ids, n - 1, &slot[1]); /* inline: no allocation */
        return 1;
    }
    if (v & HS_BITMAP) {
        HBits *b = hs_bits(h->base, v);
        uint32_t w = id >> 6;
        uint64_t bit = 1ULL << (id & 63);
        if (w >= b->words || !(b->bits[w] & bit))
            return 0;
        b->bits[w] &= ~bit;
        if (--b->n == 0) { /* only where a shrink below found no memory */
            hs_free(h, v);
            h_delete(h, slot);
            return 1;
        }
        uint32_t top = b->words;
        while (top && !b->bits[top - 1])
            top--;
        /* an array would take half the bytes at most, or every id left is small: the smaller form */
        if (b->n <= b->words || (top == 1 && !(b->bits[0] >> HS_SMALL))) {
            uint32_t *ids = PyMem_Malloc((size_t)b->n * 4), n = 0;
            if (ids == NULL) {
                PyErr_Clear(); /* keep the bitmap */
                return 1;
            }
            for (uint32_t k = 0; k < top; k++) {
                for (uint64_t x = b->bits[k]; x; x &= x - 1)
                    ids[n++] = k * 64 + (uint32_t)__builtin_ctzll(x);
            }
            hs_shrink(h, slot, ids, n);
            PyMem_Free(ids);
        }
        return 1;
    }
    HArr *a = hs_arr(h->base, v);
    uint32_t lo = harr_lower_bound(a, id);
    if (lo == a->n || a->ids[lo] != id)
        return 0;
    memmove(a->ids + lo, a->ids + lo + 1, (size_t)(a->n - lo - 1) * 4);
    a->n--;
    if (a->n < HS_INLINE || a->ids[a->n - 1] < HS_SMALL) {
        hs_shrink(h, slot, a->ids, a->n); /* inline: no allocation */
    }
    else if (a->cap > 8 && a->n * 4 < a->cap) {
        uint32_t cap = a->n * 2 < 8 ? 8 : a->n * 2;
        HArr *s = hmem_realloc(h, a, harr_bytes(a->cap), harr_bytes(cap));
        if (s != NULL) {
            h->ext_bytes -= harr_bytes(s->cap);
            s->cap = cap;
            slot[1] = hs_word(h, s, harr_bytes(cap), 0);
        }
    }
    return 1;
}

/* ------------------------------------------------------------------------------------------ */
/* Holders: eviction and ages (a view bounded in bytes)                                         */

void
infera_h_evict_at(Holders *h, uint64_t *slot, void (*each)(void *, uint32_t), void *ctx)
{
    h_wbegin(h);
    h_mark_slot(h, slot);
    uint64_t v = slot[1];
    if (!(v & HS_EXT)) {
        uint32_t ids[HS_SMALL + 1];
        uint32_t n = hs_inline_ids(v, ids);
        for (uint32_t k = 0; k < n; k++)
            each(ctx, ids[k]);
    }
    else if (v & HS_BITMAP) {
        HBits *b = hs_bits(h->base, v);
        for (uint32_t k = 0; k < b->words; k++) {
            for (uint64_t x = b->bits[k]; x; x &= x - 1)
                each(ctx, k * 64 + (uint32_t)__builtin_ctzll(x));
        }
    }
    else {
        HArr *a = hs_arr(h->base, v);
        for (uint32_t k = 0; k < a->n; k++)
            each(ctx, a->ids[k]);
    }
    hs_free(h, v);
    h_delete(h, slot);
    h_wend(h);
}

void
infera_h_tick(Holders *h)
{
    uint64_t every = h->n / 64 < 64 ? 64 : h->n / 64;
    if (!h->aging || h->touches < every)
        return;
    h->epoch++;
    h->touches = 0;
    /* clamp a 1/64th of the slots: no age byte is ever more than 255 epochs old */
    uint64_t end = h->clamp_at + h->cap / 64 + 1;
    if (end > h->cap)
        end = h->cap;
    for (uint64_t i = h->clamp_at; i < end; i++) {
        if (h->slots[2 * i + 1] != 0 && (uint8_t)(h->epoch - h->age[i]) > HS_AGE_OLD)
            h->age[i] = (uint8_t)(h->epoch - HS_AGE_OLD);
    }
    h->clamp_at = end >= h->cap ? 0 : end;
}
