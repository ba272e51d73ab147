/* The shared arena (issue 30 item 4): memory one process writes a KV index's holder table into and
 * other processes read without locks.
 *
 * One memfd, sized at creation (sparse: a page exists once written) and mapped whole by every
 * process, so an offset the writer publishes names the same bytes in each, and a read of any offset
 * inside it never faults (a freed range reads as zeros: its pages are punched out). The writer
 * alone allocates: small blocks (holder sets) from free lists by 16-byte class, carved from 64 KiB
 * chunks; large ones (tables) in whole pages, first fit among freed extents, their pages given back
 * when freed. Readers never trust what they read: every read is checked against the header's
 * sequence (u64table.h, ``seq``, a seqlock the writer holds odd while it changes the table), so a
 * block freed and reused under a reader is seen as a change and read again, and every offset is
 * checked against the size before it is followed. */
#ifndef INFERA_ARENA_H
#define INFERA_ARENA_H

#include "native.h"

#define ARENA_MAGIC 0x314e5241564b4e49ULL /* "INKVARN1", little-endian */
#define ARENA_VERSION 1
#define ARENA_PAGE 4096ULL
#define ARENA_SMALL_MAX 4096ULL /* past this, a block is large: whole pages */
#define ARENA_CHUNK (64 * 1024ULL)
#define ARENA_CLASSES (ARENA_SMALL_MAX / 16 + 1)

/* At offset 0. Written by the writer only; ``seq`` with atomics, the rest inside its odd windows. */
typedef struct {
    uint64_t magic;
    uint32_t version, header_bytes;
    uint64_t size;       /* bytes mapped */
    uint64_t seq;        /* the holder table's seqlock: odd while the writer changes it */
    uint64_t slots;      /* the holder table: its slots' offset (0: none) */
    uint64_t cap;        /* and its capacity */
    int64_t writer_pid;  /* the process that writes this arena */
    uint64_t used;       /* bytes taken: large blocks and small blocks' chunks, in pages */
} ArenaHeader;

typedef struct {
    uint64_t at, bytes;
} ArenaExtent;

typedef struct {
    uint8_t *base; /* NULL: not open */
    uint64_t size;
    int fd;        /* the memfd (the writer's; a reader's is its caller's) */
    int writable;
    /* the writer's allocator (private: a reader never allocates) */
    uint64_t top;                        /* large blocks: the first page never handed out */
    uint64_t small_free[ARENA_CLASSES];  /* per 16-byte class: the first free block (offset; 0: none) */
    uint64_t chunk_at, chunk_end;        /* the chunk small blocks are being carved from */
    ArenaExtent *ext;                    /* freed large extents, ascending, coalesced */
    size_t n_ext, cap_ext;
} Arena;

static inline ArenaHeader *
arena_header(const Arena *a)
{
    return (ArenaHeader *)a->base;
}

/* Whether [off, off + bytes) lies inside the arena past its header. */
static inline int
arena_in(const Arena *a, uint64_t off, uint64_t bytes)
{
    return off >= sizeof(ArenaHeader) && off <= a->size && bytes <= a->size - off;
}

/* A new arena of ``size`` bytes (rounded up to pages), mapped read-write: 0, or -1 with an exception. */
INFERA_INTERNAL int infera_arena_create(Arena *a, uint64_t size);
/* Map the arena in ``fd`` read-only (the fd stays the caller's): 0, or -1 with an exception. */
INFERA_INTERNAL int infera_arena_attach(Arena *a, int fd);
INFERA_INTERNAL void infera_arena_close(Arena *a);
/* ``bytes`` zeroed (writer): the offset, or 0 when the arena is full. */
INFERA_INTERNAL uint64_t infera_arena_alloc(Arena *a, uint64_t bytes);
/* Give back a block ``infera_arena_alloc(bytes)`` returned. */
INFERA_INTERNAL void infera_arena_free(Arena *a, uint64_t off, uint64_t bytes);

/* The writer's side of the seqlock around a change readers may see. */
static inline void
arena_write_begin(Arena *a)
{
    ArenaHeader *h = arena_header(a);
    __atomic_store_n(&h->seq, h->seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static inline void
arena_write_end(Arena *a)
{
    ArenaHeader *h = arena_header(a);
    __atomic_store_n(&h->seq, h->seq + 1, __ATOMIC_RELEASE);
}

#endif
