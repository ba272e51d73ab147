/* score_targets(): the kv-aware pick's loop over one group of targets (KvAwarePolicy.pick in
 * infera/router/kv_aware.py is the reference). In C because it runs per target for every request
 * routed. */
#include "counter.h"

/* ------------------------------------------------------------------------------------------ */
/* score_targets: the kv-aware pick's loop over one group of targets                           */

/* A number kept in a dict (a float or an int) as a double; ``dflt`` when the key is missing. */
static int
dict_number(PyObject *d, PyObject *key, double dflt, double *out)
{
    PyObject *v = PyDict_GetItemWithError(d, key);
    if (v == NULL) {
        if (PyErr_Occurred())
            return -1;
        *out = dflt;
        return 0;
    }
    if (PyFloat_CheckExact(v)) {
        *out = PyFloat_AS_DOUBLE(v);
        return 0;
    }
    double x = PyFloat_AsDouble(v);
    if (x == -1.0 && PyErr_Occurred())
        return -1;
    *out = x;
    return 0;
}

/* A table of blocks in flight (``active[key]``): its length, and (active_run) ``hit`` extended over
 * the blocks of ``hashes`` it holds when it holds the first one, as pick() does. Through the C type
 * when it is one, else the Python protocol (the Python twin). */
static int
active_len(PyObject *active, Py_ssize_t *n)
{
    if (Py_TYPE(active) == &infera_BlockCounterType) {
        *n = (Py_ssize_t)((BlockCounter *)active)->counts.n;
        return 0;
    }
    *n = PyObject_Length(active);
    return *n < 0 ? -1 : 0;
}

static int
active_run(PyObject *active, PyObject *hashes, const Hashes *hs, Py_ssize_t hit, Py_ssize_t *out)
{
    if (Py_TYPE(active) == &infera_BlockCounterType) {
        const Map64 *m = &((BlockCounter *)active)->counts;
        uint64_t first;
        *out = hit;
        if (hs->n > 0 && hashes_at(hs, 0, &first) == 0 && map_find(m, first) >= 0)
            *out = infera_counter_run(m, hs, hit);
        return 0;
    }
    PyObject *first = PySequence_GetItem(hashes, 0);
    if (first == NULL)
        return -1;
    int held = PySequence_Contains(active, first);
    Py_DECREF(first);
    if (held < 0)
        return -1;
    *out = hit;
    if (!held)
        return 0;
    PyObject *r = PyObject_CallMethod(active, "run", "On", hashes, hit);
    if (r == NULL)
        return -1;
    *out = PyLong_AsSsize_t(r);
    Py_DECREF(r);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* score_targets(keys, hits, active, recent, decay, unhashed, inflight, per_request, w_overlap,
 *               total, hashes, pending, held, offset) -> (tied, best_cost, best_load)
 *
 * KvAwarePolicy.pick's loop over one block-size group, for the case without lower tiers, images
 * or debug logging (the Python loop there is the reference; tests/unit/test_pick_native.py runs
 * both in lockstep). Per
 * target: load = len(active[key]) + recent[key] x decay + unhashed[key] + per_request x
 * inflight[key]; hit = hits[i] (None: all 0), extended over the blocks in flight there when
 * ``pending`` and the target has the first one in flight; cost = w_overlap x (total - hit) + load.
 * ``tied``: [(index, hit)] of the targets at the least (cost, load), in order; with ``held`` (a
 * callable: held(keys) -> the blocks cached on each key), reduced to the one with the least
 * (blocks cached, (index - offset) mod len(keys)). Costs and loads are computed in the Python
 * loop's order of operations, so ties come out the same. */
PyObject *
infera_py_score_targets(PyObject *self, PyObject *args)
{
    PyObject *keys, *hits, *active, *recent, *unhashed, *inflight, *hashes, *held;
    double decay, per_request, w_overlap;
    Py_ssize_t total, offset;
    int pending;
    if (!PyArg_ParseTuple(args, "O!OO!O!dO!O!ddnOpOn:score_targets", &PyList_Type, &keys, &hits, &PyDict_Type,
                          &active, &PyDict_Type, &recent, &decay, &PyDict_Type, &unhashed, &PyDict_Type, &inflight,
                          &per_request, &w_overlap, &total, &hashes, &pending, &held, &offset))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (hits != Py_None && (!PyList_Check(hits) || PyList_GET_SIZE(hits) != n)) {
        PyErr_SetString(PyExc_ValueError, "hits must be None or a list as long as keys");
        return NULL;
    }
    Hashes hs;
    memset(&hs, 0, sizeof(hs));
    if (pending && hashes != Py_None && infera_hashes_get(hashes, &hs) < 0)
        return NULL;
    int use_unhashed = PyDict_GET_SIZE(unhashed) > 0;
    double missed_all = w_overlap * (double)total;
    double best_cost = 0.0, best_load = 0.0;
    Py_ssize_t *tied = PyMem_Malloc((size_t)(n ? n : 1) * 2 * sizeof(Py_ssize_t)); /* (index, hit) pairs */
    Py_ssize_t ntied = 0;
    PyObject *out = NULL;
    if (tied == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        Py_ssize_t hit = 0;
        if (hits != Py_None) {
            hit = PyLong_AsSsize_t(PyList_GET_ITEM(hits, i));
            if (hit == -1 && PyErr_Occurred())
                goto done;
        }
        double load, r;
        PyObject *a = PyDict_GetItemWithError(active, key);
        if (a == NULL && PyErr_Occurred())
            goto done;
        Py_ssize_t alen = 0;
        if (a != NULL && active_len(a, &alen) < 0)
            goto done;
        if (alen > 0 && pending && hs.n > 0 && active_run(a, hashes, &hs, hit, &hit) < 0)
            goto done;
        if (dict_number(recent, key, 0.0, &r) < 0)
            goto done;
        load = alen > 0 ? (double)alen + r * decay : r * decay;
        if (use_unhashed) {
            double u;
            if (dict_number(unhashed, key, 0.0, &u) < 0)
                goto done;
            load += u;
        }
        if (per_request != 0.0) {
            double f;
            if (dict_number(inflight, key, 0.0, &f) < 0)
                goto done;
            load += per_request * f;
        }
        double cost = hit ? w_overlap * (double)(total - hit) + load : missed_all + load;
        if (ntied == 0 || cost < best_cost || (cost == best_cost && load < best_load)) {
            best_cost = cost;
            best_load = load;
            tied[0] = i;
            tied[1] = hit;
            ntied = 1;
        }
        else if (cost == best_cost && load == best_load) {
            tied[2 * ntied] = i;
            tied[2 * ntied + 1] = hit;
            ntied++;
        }
    }
    if (ntied > 1 && held != Py_None) {
        Py_ssize_t chosen = 0;
        long long least_held = 0;
        Py_ssize_t least_turn = 0;
        PyObject *counts = PyObject_CallOneArg(held, keys);
        if (counts == NULL)
            goto done;
        if (!PyList_Check(counts) || PyList_GET_SIZE(counts) != n) {
            Py_DECREF(counts);
            PyErr_SetString(PyExc_ValueError, "held(keys) must give a list as long as keys");
            goto done;
        }
        for (Py_ssize_t t = 0; t < ntied; t++) {
            long long blocks = PyLong_AsLongLong(PyList_GET_ITEM(counts, tied[2 * t]));
            if (blocks == -1 && PyErr_Occurred()) {
                Py_DECREF(counts);
                goto done;
            }
            Py_ssize_t turn = ((tied[2 * t] - offset) % n + n) % n;
            if (t == 0 || blocks < least_held || (blocks == least_held && turn < least_turn)) {
                chosen = t;
                least_held = blocks;
                least_turn = turn;
            }
        }
        Py_DECREF(counts);
        tied[0] = tied[2 * chosen];
        tied[1] = tied[2 * chosen + 1];
        ntied = 1;
    }
    PyObject *list = PyList_New(ntied);
    if (list == NULL)
        goto done;
    for (Py_ssize_t t = 0; t < ntied; t++) {
        PyObject *pair = Py_BuildValue("(nn)", tied[2 * t], tied[2 * t + 1]);
        if (pair == NULL) {
            Py_DECREF(list);
            goto done;
        }
        PyList_SET_ITEM(list, t, pair);
    }
    out = Py_BuildValue("(Ndd)", list, best_cost, best_load);
done:
    PyMem_Free(tied);
    if (pending && hashes != Py_None)
        hashes_release(&hs);
    return out;
}
