"""The sim launcher's adapter driven without an engine: argv preparation, and a session that
answers ``describe``'s two requests like a sim engine would."""
from __future__ import annotations

from infera.engine.sim.launcher import SimAdapter
from tests.unit import launcher_helpers


def prepare(argv, *launcher_flags):
    return launcher_helpers.prepare(SimAdapter(), argv, *launcher_flags)


class _Resp:
    def __init__(self, body, status=200):
        self.body, self.status = body, status

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    async def json(self, **kw):
        return self.body

    async def text(self):
        return self.body


class FakeSimSession:
    def post(self, url, **kw):  # the Messages API probe: a sim without --serve-anthropic has no such route
        return _Resp({"detail": "Not Found"}, status=404)

    def get(self, url, **kw):
        if url.endswith("/v1/models"):
            return _Resp({"data": [{"id": "m"}]})
        return _Resp('vllm:cache_config_info{block_size="16",num_gpu_blocks="9",enable_prefix_caching="True"} 1.0\n')
