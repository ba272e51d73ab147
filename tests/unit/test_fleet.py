from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord


def rec(wid, model="m", status="active", mode="mixed"):
    return WorkerRecord(worker_id=wid, url=f"http://{wid}", model_name=model, status=status, disagg_mode=mode)


def test_active_views_by_model_and_mode():
    f = Fleet()
    f.upsert(rec("b", "m1"))
    f.upsert(rec("a", "m1"))
    f.upsert(rec("c", "m2", mode="prefill"))
    f.upsert(rec("d", "m2", status="draining"))
    assert [w.worker_id for w in f.active("m1")] == ["a", "b"]
    assert [w.worker_id for w in f.active("m2", "mixed")] == []
    assert [w.worker_id for w in f.active("m2", "prefill")] == ["c"]
    assert [w.worker_id for w in f.active()] == ["a", "b", "c"]
    assert f.models() == ["m1", "m2"]
    assert f.knows_model("m2") and not f.knows_model("zz")
    assert len(f) == 4


def test_replace_all_removes_ghosts_and_notifies():
    f = Fleet()
    events = []
    f.subscribe(lambda wid, r: events.append((wid, r is not None)))
    f.upsert(rec("a"))
    f.upsert(rec("b"))
    f.replace_all([rec("b"), rec("c")])
    assert [w.worker_id for w in f.all()] == ["b", "c"]
    assert events == [("a", True), ("b", True), ("a", False), ("c", True)]


def test_identical_upsert_is_not_a_change():
    f = Fleet()
    f.upsert(rec("a"))
    gen = f.generation
    f.upsert(rec("a"))
    assert f.generation == gen
    f.upsert(rec("a", status="draining"))
    assert f.generation == gen + 1 and f.active() == ()


def test_remove_unknown_is_noop():
    f = Fleet()
    f.remove("nope")
    assert f.generation == 0


def test_listener_errors_do_not_break_updates():
    f = Fleet()
    f.subscribe(lambda wid, r: 1 / 0)
    f.upsert(rec("a"))
    assert f.get("a") is not None


def test_release_keeps_a_worker_another_entry_still_holds():
    fleet = Fleet()
    a = WorkerRecord(worker_id="w", url="http://a", model_name="m")
    b = WorkerRecord(worker_id="w", url="http://b", model_name="m")
    fleet.upsert(a)
    fleet.release("w", [b])  # entry A let go; entry B still holds w: its record wins
    assert fleet.get("w") == b
    fleet.release("w", [])  # nobody holds it any more
    assert fleet.get("w") is None
