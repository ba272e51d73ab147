"""Per-target state of the server's KV views (``infera.server.kv``): the self-check's constants and
``_TargetState``, what the bridge keeps per route key -- its event stream's progress, warm-up and
degraded marks, the self-check's prediction errors and verdicts, and its hit-rate counters.
"""
from __future__ import annotations

from collections import deque

from infera.discovery.record import WorkerRecord
from infera.server.metrics import Histogram

__all__ = ["BLOCK_BUCKETS", "ERROR_BUCKETS", "DELAY_SMOOTHING", "SILENT_AFTER_S", "DIVERGENCE_WINDOW"]

BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
ERROR_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
assert BLOCK_BUCKETS[0] == ERROR_BUCKETS[0] == 0  # a 0 is counted in slot 0 directly on the hot path
DELAY_SMOOTHING = 0.2  # weight of the newest batch in the cache view's delay_ms
# A worker that got requests whose blocks it must have stored, yet sent no event batch for
# this long, is "silent".
SILENT_AFTER_S = 10.0
# Predictions have diverged when most of the last DIVERGENCE_WINDOW informative replies (the engine
# reported, or the router predicted, a cached block) were off by more than one block. A mismatched
# tokenizer, chat template, block size or hash seed gets nearly every such reply wrong; races
# (an eviction or a prefill still running between the pick and the engine's schedule) get a few.
DIVERGENCE_WINDOW = 20


def _kv_identity(record: WorkerRecord) -> tuple:
    """What names one engine instance's event stream: a re-registration that changes it is a new
    engine (launchers bind fresh event ports per start), whose cache starts empty."""
    return (record.engine, record.kv_block_size, record.kv_events_endpoint, record.kv_events_replay_endpoint,
            record.kv_event_transport)


class _TargetState:
    __slots__ = ("worker_id", "engine", "batches", "events", "decode_errors", "last_batch_at", "last_seq",
                 "unconfirmed_since", "silent", "errors", "abs_error_sum", "observations", "exact", "verdicts",
                 "wrong", "over", "under", "delays", "delay_ewma", "cpu_s", "prompt_tokens", "predicted_tokens",
                 "reported_prompt_tokens", "reported_cached_tokens", "added_at", "fresh", "degraded", "restarts",
                 "evicted_under")

    def __init__(self, worker_id: str, engine: str, added_at: float) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.added_at = added_at  # (monotonic) the staleness of a view no batch has reached yet
        # No batch applied since the view was (re)built: the first one says whether it starts at
        # the engine's seq 0 (whole) or later (blocks stored before it are unknown: degraded).
        self.fresh = True
        self.degraded: str | None = None  # why the view may lack blocks (a reset reason), None: whole
        self.restarts = 0  # engine restarts found (re-registration or stream)
        self.batches = 0
        self.events = 0
        self.cpu_s = 0.0  # this thread's CPU in decoding and applying this target's batches
        self.decode_errors = 0
        self.last_batch_at: float | None = None
        self.last_seq: int | None = None
        self.unconfirmed_since: float | None = None  # first routed miss not yet followed by a batch
        self.silent = False
        # recent |predicted − reported| in blocks; made at the first reply (an empty deque is ~600 B,
        # and a fleet has targets that never get one)
        self.errors: deque[int] | None = None
        self.abs_error_sum = 0
        self.observations = 0
        self.exact = 0
        # Replies off by more than one block, by direction: "over" (predicted hits the engine no
        # longer had: a stale view, or an eviction between pick and schedule) and "under" (it had
        # more: a prefill finishing meanwhile, or events that have not arrived).
        self.over = 0
        self.under = 0
        # Replies with more cached than predicted on a view the byte bound evicted from: the engine
        # may still hold what the router evicted, an under-prediction the bound explains (not drift).
        self.evicted_under = 0
        # Engine batch timestamp → applied here (wall clocks: same host, or NTP between hosts).
        # Events that lag a reply leave the next turn routed on a view without that reply's blocks.
        # The server's latency buckets, 1 ms to 300 s; made at the first batch (~300 B a target that a
        # process reading the host's shared index, or an idle engine, never fills).
        self.delays: Histogram | None = None
        self.delay_ewma: float | None = None
        self.verdicts: deque[bool] | None = None  # recent informative replies: off by more than one block?
        self.wrong = 0
        # Hit-rate counters (tokens), over every completed 200 reply routed here, with or without usage:
        # the router's prompt tokens and its predicted cached share; and, of the replies whose usage
        # carried ``cached_tokens``, the same prompt tokens and the engine's reported cached tokens.
        self.prompt_tokens = 0
        self.predicted_tokens = 0
        self.reported_prompt_tokens = 0
        self.reported_cached_tokens = 0

