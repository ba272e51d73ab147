/* A target's engine-hash map (Target.emap): engine hash -> the low 32 bits of its router hash, the
 * whole key found in the holder table, where the keys that share those bits share a home
 * (u64table.h h_home) and this target holds only one of them. Where it holds two or more (about one
 * store in 2^32 / the target's blocks), the map's entries for those bits also keep the high half
 * (Target.ehigh). 12 bytes a slot instead of 16: issue 30's bytes per (block, target) entry.
 *
 * So an entry names the key it was made for, or nothing held: when a key it named is evicted (the
 * byte bound), its low bits are remembered with its high ones (Target.tomb) until the sweep that
 * deletes such entries, and another key joining with the same low bits meanwhile deletes them first
 * (the evicted key itself coming back keeps them: they name it again). Two evicted keys sharing low
 * bits keep only the later one's high bits there (one chance in 2^32). (An entry whose key left
 * through another engine hash's removal, two engine hashes naming one router hash, is not tracked:
 * it could name a key joining later with the same low bits, one chance in 2^32 a join.) */
#include "view.h"

/* The holder slot of the key the map entry at ``i`` names, if the target holds it; else NULL. */
uint64_t *
infera_view_slot_at(const GpuView *v, const Target *t, int bit, uint64_t i)
{
    uint32_t low = t->emap.vals[i];
    if (t->ehigh.n) {
        int64_t j = map_find(&t->ehigh, t->emap.keys[i]);
        if (j >= 0) {
            uint64_t *slot = h_find(&v->holders, ((uint64_t)t->ehigh.vals[j] << 32) | low);
            return slot != NULL && hs_has(v->holders.base, slot[1], (uint32_t)bit) ? slot : NULL;
        }
    }
    /* two or more cannot be (the entry would have its high half); none: evicted or removed */
    uint64_t *slot;
    return h_held_low(&v->holders, low, (uint32_t)bit, 0, 0, &slot) == 1 ? slot : NULL;
}

int
infera_view_resolve(const GpuView *v, const Target *t, int bit, uint64_t ekey, uint64_t *out)
{
    int64_t i = map_find(&t->emap, ekey);
    if (i < 0)
        return -1;
    uint64_t *slot = infera_view_slot_at(v, t, bit, (uint64_t)i);
    if (slot == NULL)
        return 0;
    *out = slot[0];
    return 1;
}

/* Delete the map entry at ``i`` (and its high half). */
static void
view_entry_delete_at(Target *t, uint64_t i)
{
    uint64_t ekey = t->emap.keys[i];
    infera_map_delete_at(&t->emap, i);
    if (t->ehigh.n) {
        uint32_t dummy;
        map_pop(&t->ehigh, ekey, &dummy);
    }
}

int
infera_view_unmap(GpuView *v, Target *t, int bit, uint64_t ekey)
{
    int64_t i = map_find(&t->emap, ekey);
    if (i < 0)
        return -1;
    uint64_t *slot = infera_view_slot_at(v, t, bit, (uint64_t)i);
    view_entry_delete_at(t, (uint64_t)i);
    if (slot == NULL || !infera_h_remove_at(&v->holders, slot, (uint32_t)bit))
        return 0;
    t->count--;
    return 1;
}

void
infera_view_sweep_map(GpuView *v, int bit)
{
    Target *t = &v->targets[bit];
    Map64 *m = &t->emap;
    if (m->n <= (uint64_t)t->count + (uint64_t)t->count / 4 + 64)
        return;
    map_free(&t->tomb); /* no entry is left that names nothing held */
    for (uint64_t i = 0; i < m->cap;) {
        /* a deletion shifts a later entry into slot i (or one seen already, kept): read i again */
        if (map_used(m, i) && infera_view_slot_at(v, t, bit, i) == NULL) {
            view_entry_delete_at(t, i);
            continue;
        }
        i++;
    }
}

/* The target joined ``h`` and already held ``other``, a key with the same low bits: its map's
 * entries for those bits (all ``other``'s, none with a high half yet) take other's high half. */
static int
view_split_low(Target *t, uint32_t low, uint64_t other)
{
    Map64 *m = &t->emap;
    for (uint64_t i = 0; i < m->cap; i++) {
        if (map_used(m, i) && m->vals[i] == low && map_find(&t->ehigh, m->keys[i]) < 0 &&
            infera_map_put(&t->ehigh, m->keys[i], (uint32_t)(other >> 32)) < 0)
            return -1;
    }
    return 0;
}

/* The target joined a key whose low bits it held before, in another key evicted since the last
 * sweep (Target.tomb), and holds no other key with them now: the entries that named the evicted key
 * go, or they would name the new one. */
static void
view_drop_low(Target *t, uint32_t low)
{
    Map64 *m = &t->emap;
    for (uint64_t i = 0; i < m->cap;) {
        /* a deletion shifts a later entry into slot i (or one seen already, kept): read i again */
        if (map_used(m, i) && m->vals[i] == low && (t->ehigh.n == 0 || map_find(&t->ehigh, m->keys[i]) < 0)) {
            infera_map_delete_at(m, i);
            continue;
        }
        i++;
    }
}

int
infera_view_store(GpuView *v, int bit, uint64_t h, int mapped, uint64_t ekey)
{
    Target *t = &v->targets[bit];
    int set = infera_h_add(&v->holders, h, (uint32_t)bit);
    if (set < 0)
        return -1;
    t->count += set;
    if (!set && !mapped)
        return 0;
    uint64_t *other_slot = NULL;
    int twins = h_held_low(&v->holders, (uint32_t)h, (uint32_t)bit, 1, h, &other_slot);
    if (set && t->tomb.n) {
        int64_t k = map_find(&t->tomb, (uint32_t)h);
        if (k >= 0) {
            /* the evicted key itself back: the entries that named it name it again (as in the twin) */
            int same = t->tomb.vals[k] == (uint32_t)(h >> 32);
            infera_map_delete_at(&t->tomb, (uint64_t)k);
            if (!same && twins == 0)
                view_drop_low(t, (uint32_t)h);
        }
    }
    if (set && twins == 1 && view_split_low(t, (uint32_t)h, other_slot[0]) < 0)
        return -1;
    if (!mapped)
        return 0;
    if (infera_map_put(&t->emap, ekey, (uint32_t)h) < 0)
        return -1;
    if (twins)
        return infera_map_put(&t->ehigh, ekey, (uint32_t)(h >> 32));
    if (t->ehigh.n) {
        uint32_t dummy;
        map_pop(&t->ehigh, ekey, &dummy);
    }
    return 0;
}
