/* BlockCounter (counter.c), a multiset of block hashes; pick.c reads it directly. */
#ifndef INFERA_COUNTER_H
#define INFERA_COUNTER_H

#include "ids.h"
#include "u64table.h"

/* A multiset of block hashes (u64): how many requests in flight on a target hold each block. */
typedef struct {
    PyObject_HEAD
    Map64 counts;
} BlockCounter;

/* The first position >= start of ``hs`` whose hash ``m`` does not hold (hs->n: all are held). */
INFERA_INTERNAL Py_ssize_t infera_counter_run(const Map64 *m, const Hashes *hs, Py_ssize_t start);

#endif
