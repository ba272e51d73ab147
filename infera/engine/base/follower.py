"""The multinode follower gate: which launcher of a multi-node engine registers.

A tensor-parallel engine spread over N nodes runs one launcher per node, but only node 0 (the
leader) serves the engine's API: SGLang's other nodes run schedulers only (and a dummy health
server), vLLM's run ``--headless``. So a launcher whose node rank is > 0 is a **follower**: it
starts its engine and keeps it alive until signalled, and never registers, never serves NATS
requests and never relays KV events.

The node rank, flag > env > default: the engine's own node-rank flag when the adapter names one
(SGLang ``--node-rank``), else ``LWS_WORKER_INDEX`` (set by a LeaderWorkerSet on every Pod of a
group: 0 on the leader), else 0. A value that is not a non-negative integer is an error, never a
silent leader: two leaders would register one engine twice.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from infera.engine.base.argv import flag_values

LWS_WORKER_INDEX = "LWS_WORKER_INDEX"


class NodeRankError(ValueError):
    """A node rank that is not a non-negative integer."""


def _parse_rank(raw: str, source: str) -> int:
    try:
        rank = int(raw.strip())
    except ValueError:
        raise NodeRankError(f"{source} must be a non-negative integer (the node's rank in a multi-node "
                            f"engine), got {raw!r}") from None
    if rank < 0:
        raise NodeRankError(f"{source} must be a non-negative integer, got {raw!r}")
    return rank


def node_rank(engine_argv: Sequence[str], rank_flags: Sequence[str], environ: Mapping[str, str]) -> tuple[int, str]:
    """(this node's rank, where it came from) for the follower gate; NodeRankError if malformed.

    ``rank_flags``: the engine's own node-rank flags (read from the pass-through argv, which the
    engine also reads); empty for an engine that has none the launcher trusts.
    """
    if rank_flags:
        values = flag_values(engine_argv, *rank_flags)
        if values is not None:
            if not values:
                raise NodeRankError(f"{rank_flags[0]} needs a value (the node's rank)")
            return _parse_rank(values[0], rank_flags[0]), rank_flags[0]
    raw = environ.get(LWS_WORKER_INDEX)
    if raw is not None and raw.strip():  # set but empty: as unset (a template placeholder left blank)
        return _parse_rank(raw, LWS_WORKER_INDEX), LWS_WORKER_INDEX
    return 0, "default"


def is_follower(rank: int) -> bool:
    return rank > 0
