"""What every KV-event subscriber (ZMQ, NATS) hands its caller: the callbacks' types, the sequence
value of a batch that carries none (``NO_SEQ``), the bounded set of reasons a view is reset
(``RESET_REASONS``: metric label values), and :class:`KvCallbacks`, the base that calls
``on_batch``/``on_reset``/``on_caught_up`` with the same per-key bookkeeping whatever the transport,
so that a callback's exception is logged and counted and never kills a reader. Re-exported by
:mod:`infera.transport.kv_events_zmq`, where callers imported these names from.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

# (the logger's name is the one these callbacks logged under before the split: log configurations name it)
log = logging.getLogger("infera.transport.kv_events_zmq")

NO_SEQ = -1
OnBatch = Callable[[str, int, bytes], None]
OnReset = Callable[[str], None]
OnCaughtUp = Callable[[str], None]
# Why a view was reset (bounded: these are metric label values).
RESET_RESTART = "restart"
RESET_GAP = "gap"
RESET_HISTORY = "history"
RESET_RECONNECT = "reconnect"
RESET_REASONS = (RESET_RESTART, RESET_GAP, RESET_HISTORY, RESET_RECONNECT)


class KvCallbacks:
    """The callbacks every KV-event subscriber (ZMQ, NATS) drives, with the same bookkeeping on its
    per-key state (``key``, ``batches``, ``last_batch_at``, ``resets``, ``reset_reasons``,
    ``reset_reason``, ``callback_errors``): a callback's exception is logged and counted, never
    kills a reader."""

    on_batch: OnBatch
    on_reset: OnReset
    on_caught_up: OnCaughtUp | None = None
    _keys: dict

    def reset_reason(self, key: str) -> str | None:
        """Why ``key``'s view was last reset (``RESET_REASONS``); None if it never was."""
        st = self._keys.get(key)
        return st.reset_reason if st is not None else None

    def _emit(self, st, seq: int, payload: bytes) -> None:
        st.batches += 1
        st.last_batch_at = time.monotonic()
        try:
            self.on_batch(st.key, seq, payload)
        except Exception:
            st.callback_errors += 1
            log.exception("KV events %s: on_batch failed for seq %d", st.key, seq)

    def _reset(self, st, reason: str) -> None:
        st.resets += 1
        st.reset_reason = reason
        st.reset_reasons[reason] = st.reset_reasons.get(reason, 0) + 1
        try:
            self.on_reset(st.key)
        except Exception:
            st.callback_errors += 1
            log.exception("KV events %s: on_reset failed", st.key)

    def _notify_caught_up(self, st) -> None:
        if self.on_caught_up is None:
            return
        try:
            self.on_caught_up(st.key)
        except Exception:
            st.callback_errors += 1
            log.exception("KV events %s: on_caught_up failed", st.key)
