/* The shared arena's mapping and its writer's allocator (arena.h). */
#define _GNU_SOURCE
#include "arena.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static uint64_t
pages_of(uint64_t bytes)
{
    return (bytes + ARENA_PAGE - 1) & ~(ARENA_PAGE - 1);
}

int
infera_arena_create(Arena *a, uint64_t size)
{
    memset(a, 0, sizeof(*a));
    a->fd = -1;
    size = pages_of(size < 2 * ARENA_CHUNK ? 2 * ARENA_CHUNK : size);
    int fd = memfd_create("infera-kv-index", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        if (fd >= 0)
            close(fd);
        return -1;
    }
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        PyErr_SetFromErrno(PyExc_OSError);
        close(fd);
        return -1;
    }
    a->base = p;
    a->size = size;
    a->fd = fd;
    a->writable = 1;
    a->top = ARENA_PAGE; /* the header's page */
    ArenaHeader *h = arena_header(a);
    h->version = ARENA_VERSION;
    h->header_bytes = sizeof(ArenaHeader);
    h->size = size;
    h->writer_pid = (int64_t)getpid();
    __atomic_store_n(&h->magic, ARENA_MAGIC, __ATOMIC_RELEASE);
    return 0;
}

int
infera_arena_attach(Arena *a, int fd)
{
    memset(a, 0, sizeof(*a));
    a->fd = -1;
    struct stat st;
    if (fstat(fd, &st) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    uint64_t size = (uint64_t)st.st_size;
    if (size < ARENA_PAGE || size % ARENA_PAGE) {
        PyErr_SetString(PyExc_ValueError, "not a KV index arena (its size)");
        return -1;
    }
    void *p = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    const ArenaHeader *h = p;
    if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != ARENA_MAGIC || h->version != ARENA_VERSION ||
        h->header_bytes != sizeof(ArenaHeader) || h->size != size) {
        munmap(p, size);
        PyErr_SetString(PyExc_ValueError, "not a KV index arena of this version");
        return -1;
    }
    a->base = p;
    a->size = size;
    return 0;
}

void
infera_arena_close(Arena *a)
{
    if (a->base != NULL)
        munmap(a->base, a->size);
    if (a->fd >= 0)
        close(a->fd);
    PyMem_Free(a->ext);
    memset(a, 0, sizeof(*a));
    a->fd = -1;
}

/* Give the pages of [at, at + bytes) back to the OS: they read as zeros from now on. */
static void
punch(Arena *a, uint64_t at, uint64_t bytes)
{
    if (fallocate(a->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)at, (off_t)bytes) < 0)
        memset(a->base + at, 0, bytes); /* no hole punching here: at least it is zeroed */
}

static uint64_t
large_alloc(Arena *a, uint64_t bytes)
{
    bytes = pages_of(bytes);
    for (size_t k = 0; k < a->n_ext; k++) { /* first fit among the freed extents (zeros: punched) */
        ArenaExtent *e = &a->ext[k];
        if (e->bytes < bytes)
            continue;
        uint64_t at = e->at;
        e->at += bytes;
        e->bytes -= bytes;
        if (e->bytes == 0) {
            memmove(e, e + 1, (a->n_ext - k - 1) * sizeof(*e));
            a->n_ext--;
        }
        return at;
    }
    if (bytes > a->size - a->top)
        return 0;
    uint64_t at = a->top; /* never handed out: zeros */
    a->top += bytes;
    return at;
}

static void
large_free(Arena *a, uint64_t at, uint64_t bytes)
{
    bytes = pages_of(bytes);
    punch(a, at, bytes);
    if (at + bytes == a->top) { /* the last block: the top comes down, and a free extent below it too */
        a->top = at;
        if (a->n_ext && a->ext[a->n_ext - 1].at + a->ext[a->n_ext - 1].bytes == a->top) {
            a->top = a->ext[a->n_ext - 1].at;
            a->n_ext--;
        }
        return;
    }
    size_t k = 0;
    while (k < a->n_ext && a->ext[k].at < at)
        k++;
    int joins_prev = k > 0 && a->ext[k - 1].at + a->ext[k - 1].bytes == at;
    int joins_next = k < a->n_ext && at + bytes == a->ext[k].at;
    if (joins_prev && joins_next) {
        a->ext[k - 1].bytes += bytes + a->ext[k].bytes;
        memmove(a->ext + k, a->ext + k + 1, (a->n_ext - k - 1) * sizeof(ArenaExtent));
        a->n_ext--;
        return;
    }
    if (joins_prev) {
        a->ext[k - 1].bytes += bytes;
        return;
    }
    if (joins_next) {
        a->ext[k].at = at;
        a->ext[k].bytes += bytes;
        return;
    }
    if (a->n_ext == a->cap_ext) {
        size_t cap = a->cap_ext ? a->cap_ext * 2 : 16;
        ArenaExtent *g = PyMem_Realloc(a->ext, cap * sizeof(ArenaExtent));
        if (g == NULL)
            return; /* the pages went back; only their range is forgotten */
        a->ext = g;
        a->cap_ext = cap;
    }
    memmove(a->ext + k + 1, a->ext + k, (a->n_ext - k) * sizeof(ArenaExtent));
    a->ext[k].at = at;
    a->ext[k].bytes = bytes;
    a->n_ext++;
}

uint64_t
infera_arena_alloc(Arena *a, uint64_t bytes)
{
    ArenaHeader *h = arena_header(a);
    if (bytes > ARENA_SMALL_MAX) {
        uint64_t at = large_alloc(a, bytes);
        if (at)
            h->used += pages_of(bytes);
        return at;
    }
    uint64_t cls = (bytes + 15) / 16, size = cls * 16;
    if (cls == 0) {
        cls = 1;
        size = 16;
    }
    uint64_t at = a->small_free[cls];
    if (at) {
        memcpy(&a->small_free[cls], a->base + at, 8); /* the next free block of the class */
        memset(a->base + at, 0, size);
    }
    else {
        if (a->chunk_end - a->chunk_at < size) {
            uint64_t chunk = large_alloc(a, ARENA_CHUNK); /* what the old chunk had left is not reused */
            if (chunk == 0)
                return 0;
            h->used += ARENA_CHUNK;
            a->chunk_at = chunk;
            a->chunk_end = chunk + ARENA_CHUNK;
        }
        at = a->chunk_at; /* carved from a fresh chunk: zeros */
        a->chunk_at += size;
    }
    return at;
}

void
infera_arena_free(Arena *a, uint64_t off, uint64_t bytes)
{
    if (off == 0)
        return;
    if (bytes > ARENA_SMALL_MAX) {
        arena_header(a)->used -= pages_of(bytes);
        large_free(a, off, bytes);
        return;
    }
    uint64_t cls = bytes ? (bytes + 15) / 16 : 1;
    memcpy(a->base + off, &a->small_free[cls], 8);
    a->small_free[cls] = off;
}
