"""The command lines the renderer puts in each container: the server's, every worker's (its PD
role as each engine spells it, the multi-node flags from the LWS env, kvd's socket, or, rendering
for the sim, the user's args the sim accepts with real engines' spellings translated), the GAIE
endpoint picker's and its per-worker frontend sidecar's, all with the same discovery and
transport flags. Every flag named here exists in its launcher's argparse (the tests check).
"""
from __future__ import annotations

import json

from infera.operator.render_base import (EPP_GRPC_PORT, EPP_HEALTH_PORT, SGLANG_DIST_INIT_PORT, _Ctx,
                                         etcd_endpoint, nats_url, worker_label_selector)
from infera.operator.spec import KV_ROLES, Deployment, ServiceSpec, SpecError, has_flag

# What the sim accepts (tests/unit/test_operator_render.py checks these against its parsers):
# the launcher's flags, which every engine launcher shares ...
SIM_LAUNCHER_VALUE_FLAGS = frozenset({
    "--advertise-host", "--discovery-backend", "--drain-settle", "--drain-timeout", "--engine-entrypoint",
    "--engine-stop-timeout", "--etcd-cacert", "--etcd-cert", "--etcd-endpoint", "--etcd-key",
    "--etcd-password-file", "--etcd-prefix", "--etcd-user", "--fleet-key-file", "--k8s-namespace",
    "--k8s-pod-name", "--kv-event-transport", "--lease-ttl", "--log-level", "--nats-creds", "--nats-nkey-seed",
    "--nats-password-file", "--nats-req-idle-timeout", "--nats-req-max-duration", "--nats-req-max-pending",
    "--nats-server", "--nats-tls-ca", "--nats-tls-cert", "--nats-tls-key", "--nats-token-file", "--nats-user",
    "--ready-timeout", "--request-transport"})
SIM_LAUNCHER_BOOL_FLAGS = frozenset({"--disaggregation-allow-tcp", "--no-disaggregation-allow-tcp",
                                     "--enable-kv-events", "--no-enable-kv-events"})
# ... and the simulated engine's knobs that mean the same on any engine (not its host/port, PD
# config or KV-events config, which the renderer owns, nor --max-model-len, which must fit the
# simulated cache).
SIM_ENGINE_VALUE_FLAGS = frozenset({"--block-size", "--kv-bytes-per-token", "--kv-hold-timeout",
                                    "--kv-offload-blocks", "--kv-offload-load-ms-per-block",
                                    "--kv-transfer-bandwidth", "--kv-transfer-timeout", "--max-num-batched-tokens",
                                    "--max-num-seqs", "--model", "--num-gpu-blocks", "--seed", "--speedup"})
# Real engines' spellings of the sim's flags.
SIM_FLAG_ALIASES = {"--model-path": "--model", "--page-size": "--block-size"}


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------
def _plane_flags(ctx: _Ctx, *, atom: bool = False, server: bool = False) -> list[str]:
    """Discovery and transport flags, the same on the server and every worker."""
    dep = ctx.dep
    if dep.discovery == "etcd":
        flags = ["--discovery-backend", "etcd", "--etcd-endpoint", etcd_endpoint(dep, ctx.namespace)]
    else:
        flags = ["--discovery-backend", "kubernetes"]
        if server:  # the server lists the worker Pods; a worker patches its own Pod
            flags += ["--k8s-label-selector", worker_label_selector(dep)]
    if dep.nats_deployed and not atom:
        flags += ["--request-transport", "nats", "--kv-event-transport", "nats",
                  "--nats-server", nats_url(dep, ctx.namespace)]
    elif dep.external_nats and not atom:  # the user's broker: NATS_SERVER in spec.envs names it
        flags += ["--request-transport", "nats", "--kv-event-transport", "nats"]
    else:  # inside a Pod the defaults are NATS: say HTTP and ZMQ when there is no broker
        flags += ["--request-transport", "http", "--kv-event-transport", "zmq"]
    return flags


def server_command(ctx: _Ctx, svc: ServiceSpec) -> tuple[list[str], list[str]]:
    """(command, args) of a server pool's main container."""
    args = ["--host", "0.0.0.0", "--port", str(svc.port), *_plane_flags(ctx, server=True), *svc.args]
    return ["python3", "-m", "infera.server"], args


def _with_kv_role(raw: str, role: str) -> str:
    cfg = json.loads(raw)
    cfg["kv_role"] = KV_ROLES[role]
    return json.dumps(cfg, separators=(",", ":"))


def _role_args(backend: str, svc: ServiceSpec) -> tuple[list[str], list[str]]:
    """(flags to add, the user's args rewritten) for the pool's PD role."""
    user = list(svc.args)
    if svc.role == "mixed":
        return [], user
    if backend == "sglang":
        if has_flag(user, "--disaggregation-mode"):
            return [], user  # spec.py checked it agrees with the role
        return ["--disaggregation-mode", svc.role], user
    # vLLM, ATOM, the sim: the role is the config's kv_role (never --disaggregation-mode).
    if has_flag(user, "--kv-transfer-config"):  # the user's config, its kv_role set to the pool's
        out = []
        i = 0
        while i < len(user):
            tok = user[i]
            if tok == "--kv-transfer-config" and i + 1 < len(user):
                out += [tok, _with_kv_role(user[i + 1], svc.role)]
                i += 2
                continue
            if tok.startswith("--kv-transfer-config="):
                tok = "--kv-transfer-config=" + _with_kv_role(tok.split("=", 1)[1], svc.role)
            out.append(tok)
            i += 1
        return [], out
    connector = "mooncake" if backend == "atom" else "NixlConnector"
    cfg = {"kv_connector": connector, "kv_role": KV_ROLES[svc.role]}
    return ["--kv-transfer-config", json.dumps(cfg, separators=(",", ":"))], user


def _multinode_args(backend: str, svc: ServiceSpec, *, follower: bool) -> list[str]:
    if not svc.multinode:
        return []
    user = svc.args
    wanted: list[tuple[str, str]] = []
    if backend == "sglang":
        wanted = [("--nnodes", str(svc.number_of_nodes)), ("--node-rank", "$(LWS_WORKER_INDEX)"),
                  ("--dist-init-addr", f"$(LWS_LEADER_ADDRESS):{SGLANG_DIST_INIT_PORT}")]
    elif backend == "vllm":
        # vLLM's multiprocessing multi-node mode (no Ray cluster to form): rank 0 serves, the others --headless
        wanted = [("--distributed-executor-backend", "mp"), ("--nnodes", str(svc.number_of_nodes)),
                  ("--node-rank", "$(LWS_WORKER_INDEX)"), ("--master-addr", "$(LWS_LEADER_ADDRESS)")]
    out = [tok for flag, value in wanted if not has_flag(user, flag) for tok in (flag, value)]
    if backend == "vllm" and follower and not has_flag(user, "--headless"):
        out.append("--headless")
    return out


def _kvd_args(ctx: _Ctx, svc: ServiceSpec) -> list[str]:
    if not ctx.dep.kvd.enabled or svc.role == "decode":
        return []
    flag = {"vllm": "--kvd-socket", "sglang": "--infera-kvd-socket"}.get(ctx.dep.backend)
    if flag is None or has_flag(svc.args, flag):
        return []
    return [flag, ctx.dep.kvd.socket_path]


def _sim_user_args(dep: Deployment, svc: ServiceSpec, path: str) -> list[str]:
    """The user's args that mean something to the sim, real engines' spellings translated."""
    user = list(svc.args)
    if dep.backend == "sim":
        return user
    out: list[str] = []
    i = 0
    while i < len(user):
        tok = user[i]
        name, eq, inline = tok.partition("=")
        name = SIM_FLAG_ALIASES.get(name, name)
        if name in SIM_LAUNCHER_BOOL_FLAGS:
            out.append(name)
            i += 1
        elif name in SIM_LAUNCHER_VALUE_FLAGS or name in SIM_ENGINE_VALUE_FLAGS or name == "--served-model-name":
            if eq:
                out.append(f"{name}={inline}")
                i += 1
            elif i + 1 < len(user):
                out += [name, user[i + 1]]
                i += 2
                if name == "--served-model-name":  # vLLM takes several names; skip the aliases
                    while i < len(user) and not user[i].startswith("-"):
                        i += 1
            else:
                i += 1
        else:  # the real engine's own flag: dropped with its values
            i += 1
            if tok.startswith("-") and not eq:
                while i < len(user) and not user[i].startswith("-"):
                    i += 1
    if not has_flag(out, "--model"):
        raise SpecError(f"{path}.args: the sim needs the model: --model or --model-path")
    return out


def worker_command(ctx: _Ctx, svc: ServiceSpec, *, follower: bool = False) -> tuple[list[str], list[str]]:
    """(command, args) of a worker pool's main container (``follower``: an LWS worker Pod)."""
    dep = ctx.dep
    path = f"spec.services.{svc.name}"
    drain = [] if dep.drain.drain_timeout_seconds is None else ["--drain-timeout",
                                                                 str(dep.drain.drain_timeout_seconds)]
    if ctx.options.sim:
        role_flags: list[str] = []
        if svc.role != "mixed":
            cfg = {"kv_connector": "NixlConnector", "kv_role": KV_ROLES[svc.role]}
            role_flags = ["--kv-transfer-config", json.dumps(cfg, separators=(",", ":"))]
        user = _sim_user_args(dep, svc, path)
        if dep.backend == "sim":  # already the sim's args: the role as for vLLM
            role_flags, user = _role_args("sim", svc)
        args = [*_plane_flags(ctx), *drain, "--host", "0.0.0.0", "--port", str(svc.port), *role_flags, *user]
        return ["python3", "-m", "infera.engine.sim"], args
    backend = dep.backend
    role_flags, user = _role_args(backend, svc)
    address = ["--host", "0.0.0.0", "--server-port" if backend == "atom" else "--port", str(svc.port)]
    args = [*_plane_flags(ctx, atom=backend == "atom"), *drain, *_kvd_args(ctx, svc), *address, *role_flags,
            *_multinode_args(backend, svc, follower=follower), *user]
    return ["python3", "-m", f"infera.engine.{backend}"], args


def epp_command(ctx: _Ctx) -> tuple[list[str], list[str]]:
    """(command, args) of the GAIE endpoint picker: it discovers the workers as the server does,
    picks kv-aware from the same KV events, and names ``<pod ip>:<frontendPort>`` (the sidecar) as
    the destination. TLS on the ext_proc port (gateways connect with TLS and skip verification, as
    GAIE's reference EPP expects); the health port stays plaintext for the kubelet's gRPC probe."""
    gaie = ctx.dep.gaie
    assert gaie.tokenizer_path is not None  # spec.py requires it with gaie.enabled
    # The server's plane flags: the same discovery and KV events, and with NATS the replicas share
    # in-flight state (--replica-sync defaults to nats there) as server replicas do.
    args = ["--host", "0.0.0.0", "--grpc-port", str(EPP_GRPC_PORT), "--grpc-health-port", str(EPP_HEALTH_PORT),
            "--destination-port", str(gaie.frontend_port), "--secure-serving",
            *_plane_flags(ctx, server=True),
            "--router-policy", "kv-aware", "--router-tokenizer-path", gaie.tokenizer_path]
    return ["python3", "-m", "infera.gaie"], args


def frontend_command(ctx: _Ctx) -> tuple[list[str], list[str]]:
    """(command, args) of the per-worker GAIE sidecar: an ``infera.server`` that routes each request
    to the worker the EPP named (``x-worker-instance-id``; for PD the pair, with
    ``x-prefill-instance-id``), over NATS requests when NATS is deployed, else HTTP. It picks
    nothing itself: one process, round-robin (no tokenizer), no replica sync or engine scrapes."""
    args = ["--host", "0.0.0.0", "--port", str(ctx.dep.gaie.frontend_port), "--router-mode", "direct",
            *_plane_flags(ctx, server=True),
            "--router-policy", "round-robin", "--workers", "1", "--replica-sync", "off",
            "--engine-scrape-interval", "0"]
    return ["python3", "-m", "infera.server"], args
