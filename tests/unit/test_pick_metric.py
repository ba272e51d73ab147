"""infera_router_pick_seconds: every policy pick is timed per leg role (mixed, prefill, decode)
in sub-millisecond buckets, so a bench can read the pick itself from /metrics."""
from __future__ import annotations

import json

from infera.gaie.picker import EndpointPicker
from infera.server.metrics import PICK_BUCKETS, Histogram
from tests.unit.test_gaie_picker import stack_with, worker


def series(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


async def test_each_pick_is_observed_under_its_role():
    stack = stack_with([worker("w1"), worker("w2")], "--router-policy", "round-robin")
    picker = EndpointPicker(stack.router, destination_port=8000)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    for _ in range(3):
        (await picker.pick("/v1/chat/completions", body, {})).finish(200)
    text = stack.metrics.render().decode()
    counts = series(text, "infera_router_pick_seconds_count")
    assert counts == {'infera_router_pick_seconds_count{role="mixed"}': 3.0}
    buckets = series(text, "infera_router_pick_seconds_bucket")
    assert buckets['infera_router_pick_seconds_bucket{le="+Inf",role="mixed"}'] == 3.0
    assert len(buckets) == len(PICK_BUCKETS) + 1


def test_pick_buckets_resolve_sub_millisecond_picks():
    h = Histogram(PICK_BUCKETS)
    for seconds in (20e-6, 80e-6, 0.9e-3, 0.2):
        h.observe(seconds)
    assert dict(h.cumulative()) == {"2.5e-05": 1, "5e-05": 1, "0.0001": 2, "0.00025": 2, "0.0005": 2, "0.001": 3,
                                    "0.0025": 3, "0.005": 3, "0.01": 3, "0.025": 3, "+Inf": 4}
