"""The sim launcher's adapter driven without an engine: argv preparation, and a session that
answers ``describe``'s two requests like a sim engine would."""
from __future__ import annotations

from infera.engine.sim.launcher import SimAdapter
from tests.unit import launcher_helpers


def prepare(argv, *launcher_flags):
    return launcher_helpers.prepare(SimAdapter(), argv, *launcher_flags)


class _Resp:
    def __init__(self, body):
        self.body = body

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    async def json(self):
        return self.body

    async def text(self):
        return self.body


class FakeSimSession:
    def get(self, url, **kw):
        if url.endswith("/v1/models"):
            return _Resp({"data": [{"id": "m"}]})
        return _Resp('vllm:cache_config_info{block_size="16",num_gpu_blocks="9",enable_prefix_caching="True"} 1.0\n')
