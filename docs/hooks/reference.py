"""The site's reference pages, generated at build time so they cannot drift from the code: every
command's flags, read from the argparse parsers of every entry point (the console scripts in
``pyproject.toml`` and every ``python -m infera.…`` module), and every metric, read from the
processes' own Prometheus registries (a server built in-process with every optional part on, kvd,
and the simulated engine's vLLM and SGLang flavours). ``mkdocs.yml`` loads this file as a hook:
``on_files`` adds ``reference/cli.md`` and ``reference/metrics.md`` to the site, and the Markdown
kept beside the code (``bench/README.md``, ``CONTRIBUTING.md``) as pages of their own.
``tests/unit/test_docs_reference.py`` uses the same functions to fail on a flag or metric without
a description and on an entry point the generator does not reach.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import inspect
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "infera"
CLI_PAGE = "reference/cli.md"
METRICS_PAGE = "reference/metrics.md"

# Entry points that dispatch on a first word before any parser (``python -m infera.operator
# render|crd|run``): the words whose parsers the reference shows (``crd`` takes no flags).
SUBCOMMANDS: dict[str, tuple[str, ...]] = {"infera.operator": ("render", "run")}

ENV_SUFFIX = re.compile(r"\s*\[env ([^\]]+)\]\s*$")


# -- entry points ------------------------------------------------------------------------------------

@dataclass
class EntryPoint:
    """One runnable command: its ``python -m`` module (or None for a script-only one), the
    function it calls, and the console scripts that call the same function."""

    module: str | None
    target: str  # "package.module:function"
    scripts: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        return f"python -m {self.module}" if self.module else self.scripts[0]


def console_scripts(root: Path = REPO) -> dict[str, str]:
    """``[project.scripts]`` of pyproject.toml: script name → ``module:function``."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the table's simple ``name = "module:function"`` lines
        text = (root / "pyproject.toml").read_text(encoding="utf-8")
        section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
        return dict(re.findall(r'^([\w.-]+)\s*=\s*"([^"]+)"', section, re.M))
    with open(root / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["project"].get("scripts", {}))


def main_modules(package: Path = PACKAGE) -> list[str]:
    """Every module of the package runnable as ``python -m``: a ``__main__.py`` (its package's
    name) or a module with an ``if __name__ == "__main__":`` block."""
    found = set()
    for path in sorted(package.rglob("*.py")):
        if "__pycache__" in path.parts or 'if __name__ == "__main__":' not in path.read_text(encoding="utf-8"):
            continue
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__main__":
            parts.pop()
        found.add(".".join(parts))
    return sorted(found)


def _target_of(module: str) -> str:
    """The function ``python -m module`` runs: the module's (or its ``__main__``'s) ``main``."""
    for name in (f"{module}.__main__", module):
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        fn = getattr(mod, "main", None)
        if callable(fn):
            return f"{fn.__module__}:{fn.__qualname__}"
    raise LookupError(f"python -m {module}: no main() to document (give the module one)")


def entry_points(root: Path = REPO) -> list[EntryPoint]:
    """Every command, once: a console script that runs the same function as a ``python -m``
    module is listed with it."""
    by_target: dict[str, EntryPoint] = {}
    for module in main_modules(root / "infera"):
        target = _target_of(module)
        by_target.setdefault(target, EntryPoint(module, target))
    for script, target in sorted(console_scripts(root).items()):
        mod, _, func = target.partition(":")
        fn = getattr(importlib.import_module(mod), func)
        resolved = f"{fn.__module__}:{fn.__qualname__}"
        by_target.setdefault(resolved, EntryPoint(None, resolved)).scripts.append(script)
    return sorted(by_target.values(), key=_reading_order)


# The commands a reader looks for first; the rest (the sim's internals, statctl) follow by name.
READING_ORDER = ("infera.server", "infera.up", "infera.engine.vllm", "infera.engine.sglang", "infera.engine.atom",
                 "infera.engine.sim", "infera.kvd", "infera.gaie", "infera.operator", "infera.preflight")


def _reading_order(entry: EntryPoint) -> tuple[int, str]:
    module = entry.module or ""
    return (READING_ORDER.index(module) if module in READING_ORDER else len(READING_ORDER), entry.title)


# -- parsers -----------------------------------------------------------------------------------------

class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
    raise _Captured(self)


@contextlib.contextmanager
def _quiet_environment(argv: list[str]) -> Iterator[None]:
    """No environment variable (so the defaults shown are the documented ones, not this
    machine's), this argv, and parsing that stops at the first parser asked to parse."""
    with mock.patch.dict(os.environ, {"PATH": os.environ.get("PATH", "")}, clear=True), \
            mock.patch.object(sys, "argv", argv), \
            mock.patch.object(argparse.ArgumentParser, "parse_args", _capture), \
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", _capture), \
            mock.patch.object(argparse.ArgumentParser, "parse_intermixed_args", _capture):
        yield


def parsers_of(entry: EntryPoint) -> list[tuple[str, argparse.ArgumentParser]]:
    """(subcommand or "", parser) for each parser the entry point builds: its function is called
    with every parse stopped at once, so nothing runs past the parser."""
    mod, _, func = entry.target.partition(":")
    fn: Callable[..., Any] = getattr(importlib.import_module(mod), func)
    takes_argv = bool(inspect.signature(fn).parameters)
    found = []
    for word in SUBCOMMANDS.get(entry.module or "", ("",)):
        argv = [word] if word else []
        with _quiet_environment([entry.title, *argv]):
            try:
                fn(argv) if takes_argv else fn()
            except _Captured as c:
                found.append((word, c.parser))
                continue
        raise LookupError(f"{entry.title} {word}: no argparse parser was asked to parse")
    return found


@dataclass
class Flag:
    names: list[str]
    env: str
    default: str
    help: str
    required: bool


# A help text that says its default is computed where the process runs ("default: 1/8 of this
# host's memory"): the value this build machine computed would mislead, so the column says so.
HOST_DEFAULT = re.compile(r"default[^()\[\]]*\bthis (host|machine|process)\b", re.I)
BINARY_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))
HOST_DEPENDENT = "this host's (see meaning)"
CURRENT_PYTHON = "the current Python"
DESCRIBED_DEFAULTS = (HOST_DEPENDENT, CURRENT_PYTHON)  # words, not values: shown without code marks


def _default_text(action: argparse.Action) -> str:
    d = action.default
    if action.help and HOST_DEFAULT.search(action.help):
        return HOST_DEPENDENT
    if isinstance(d, int) and not isinstance(d, bool) and action.dest.endswith("_bytes") and d >= 1024:
        for size, unit in BINARY_UNITS:
            if d % size == 0:
                return f"{d // size} {unit}"
    if d is None or d is argparse.SUPPRESS or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return ""
    if d is False and action.nargs == 0:
        return "off"
    if d is True and action.nargs == 0:
        return "on"
    if d == sys.executable:
        return CURRENT_PYTHON
    if isinstance(d, (list, tuple)):
        return " ".join(map(str, d))
    return str(d)


def _help_text(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:
        try:
            text = text % {**vars(action), "prog": prog, "default": _default_text(action)}
        except (KeyError, TypeError, ValueError):
            pass
    return " ".join(text.split())


def flags_of(parser: argparse.ArgumentParser) -> list[Flag]:
    """Every option and positional of ``parser`` (help's ``-h`` left out), its env variable (the
    ``[env X]`` that ``infera.config.add_flag`` appends) split off the help."""
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help is argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._SubParsersAction):
            continue
        help_text = _help_text(action, parser.prog)
        env = ""
        m = ENV_SUFFIX.search(help_text)
        if m:
            env, help_text = m.group(1), help_text[:m.start()]
        names = list(action.option_strings) or [action.metavar or action.dest]
        if isinstance(action, argparse.BooleanOptionalAction):
            names = [n for n in names if not n.startswith("--no-")] + [n for n in names if n.startswith("--no-")]
        rows.append(Flag(names, env, _default_text(action), help_text, bool(action.required)))
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def cli_markdown(entries: list[EntryPoint] | None = None) -> str:
    entries = entry_points() if entries is None else entries
    out = ["# Command reference", "",
           "Generated from each command's own argument parser when the site is built "
           "(`docs/hooks/reference.py`); `tests/unit/test_docs_reference.py` fails on a flag without a "
           "description. Every flag follows *flag > env > default*: the env column names the variable "
           "that replaces the default. Defaults are those of a process started outside a Pod (inside one, "
           "the plane flags default to Kubernetes + NATS, see [Planes](../concepts.md#planes)). A worker's "
           "launcher passes every flag it does not know to its engine verbatim: the simulator's own are under "
           "`python -m infera.engine.sim.server`, the real engines' in their own documentation.", ""]
    for entry in entries:
        out.append(f"## `{entry.title}`")
        out.append("")
        if entry.scripts:
            out.append("Console script: " + ", ".join(f"`{s}`" for s in entry.scripts) + ".")
            out.append("")
        for word, parser in parsers_of(entry):
            if word:
                out += [f"### `{entry.title} {word}`", ""]
            if parser.description:
                out += [" ".join(parser.description.split()), ""]
            rows = flags_of(parser)
            if rows:
                out += ["| flag | env | default | meaning |", "|---|---|---|---|"]
                for r in rows:
                    names = ", ".join(f"`{n}`" for n in r.names)
                    default = ("required" if r.required else r.default if r.default in DESCRIBED_DEFAULTS
                               else f"`{_cell(r.default)}`" if r.default else "")
                    env = ", ".join(f"`{e.strip()}`" for e in r.env.split(",")) if r.env else ""
                    out.append(f"| {names} | {env} | {default} | {_cell(r.help)} |")
                out.append("")
            if parser.epilog:
                out += [" ".join(parser.epilog.split()), ""]
    return "\n".join(out)


# -- metrics -----------------------------------------------------------------------------------------

@dataclass
class Family:
    name: str  # as scraped: counters with _total
    type: str
    labels: list[str]
    help: str


def _families(collected: Any, labelnames: tuple[str, ...] = ()) -> list[Family]:
    """``labelnames``: those of the prometheus_client metric object that collected these (its
    families carry only samples); a ``*MetricFamily`` built by a collector knows its own."""
    out = []
    for fam in collected:
        labels = list(getattr(fam, "_labelnames", ()) or labelnames)
        name = fam.name + ("_total" if fam.type == "counter" else "")
        out.append(Family(name, fam.type, labels, " ".join((fam.documentation or "").split())))
    return out


def _registry_families(registry: Any) -> list[Family]:
    """Every family of a prometheus_client registry, each with its collector's label names."""
    out = []
    for collector in list(registry._collector_to_names):
        out += _families(collector.collect(), tuple(getattr(collector, "_labelnames", ())))
    return out


async def _server_families() -> list[Family]:
    """A server built in-process, nothing started, with every part that has series: kv-aware
    routing, the NATS plane and replica sync, API keys and tenant limits, the fair queue, one
    child of a ``--workers 2`` server, and its HTTP app."""
    from infera.server.app import ServerState, build_app
    from infera.server.cli import build_parser
    from infera.server.main import InferaServer
    from infera.server.supervisor import ChildContext

    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.yaml"
        keys.write_text("keys:\n  - sha256: '" + "0" * 64 + "'\n    tenant: docs\n")
        args = build_parser({}).parse_args([
            "--etcd-endpoint", "127.0.0.1:2379", "--router-policy", "kv-aware",
            "--request-transport", "nats", "--kv-event-transport", "nats", "--replica-sync", "nats",
            "--api-keys-file", str(keys), "--max-inflight-per-worker", "1"])
        server = InferaServer(args, process=ChildContext(index=0, count=2, runtime_dir=tmp, port=0))
        # The app registers collectors of its own (e.g. the Anthropic route's): build it, start nothing.
        build_app(ServerState(server.fleet, server.router, server.metrics, args.max_request_bytes, kv=server.kv,
                              nats=server.nats, tokenizers=server.tokenizers, api_keys=server.api_keys,
                              limiter=server.limiter, admission=server.admission))
        return _families(server.metrics.registry.collect())


def _kvd_families() -> list[Family]:
    from infera.kvd.metrics import KvdMetrics

    return _registry_families(KvdMetrics().registry)


def _sim_families(flavor: str, *engine_argv: str) -> list[Family]:
    from infera.engine.sim.engine import SimEngine
    from infera.engine.sim.metrics import METRICS_FLAVORS
    from infera.engine.sim.server import parse_args

    engine = SimEngine(parse_args(["--model", "sim-model", *engine_argv]), metrics_flavor=flavor)
    return _families(METRICS_FLAVORS[flavor](engine).collect())


# A NIXL prefill/decode sim adds vLLM's NIXL transfer series to the mixed engine's.
NIXL = ("--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')


def metric_families() -> dict[str, list[Family]]:
    """Process → its families, each registry built fresh here (no process-global state)."""
    return {
        "server": asyncio.run(_server_families()),
        "kvd": _kvd_families(),
        "sim (vLLM names)": _sim_families("vllm", *NIXL),
        "sim (SGLang names)": _sim_families("sglang"),
    }


PROCESS_NOTES = {
    "server": "`GET /metrics` of `python -m infera.server` (and the routing series of the GAIE endpoint "
              "picker's `--metrics-port`). Per-worker series carry `worker_id` (a DP rank: "
              "`<worker_id>#dp<rank>`) and go when the worker leaves; with `--workers N` every series "
              "also carries `process`. Some families appear only with their feature on (kv-aware "
              "routing, NATS, API keys, the fair queue, `--workers N`). What each one means in practice: "
              "[Observability](../observability.md#metrics).",
    "kvd": "`python -m infera.kvd --metrics-port`: the per-host KV-cache daemon ([kvd](../kvd.md)).",
    "sim (vLLM names)": "The simulated engine's `/metrics` under vLLM's names (what the launchers and the "
                        "server's self-check read from a real vLLM).",
    "sim (SGLang names)": "The SGLang stand-in's `/metrics` under SGLang's names.",
}


def metrics_markdown(families: dict[str, list[Family]] | None = None) -> str:
    families = metric_families() if families is None else families
    out = ["# Metrics reference", "",
           "Generated from each process's own Prometheus registry when the site is built "
           "(`docs/hooks/reference.py`); `tests/unit/test_docs_reference.py` fails on a metric without "
           "a description.", ""]
    for process, fams in families.items():
        out += [f"## {process}", "", PROCESS_NOTES.get(process, ""), "",
                "| name | type | labels | description |", "|---|---|---|---|"]
        for f in fams:
            out.append(f"| `{f.name}` | {f.type} | {', '.join(f.labels)} | {_cell(f.help)} |")
        out.append("")
    return "\n".join(out)


# -- pages kept beside the code -----------------------------------------------------------------------

# Markdown files that live beside what they describe and are shown on the site as they are.
COPIED_PAGES = {"bench.md": REPO / "bench" / "README.md", "contributing.md": REPO / "CONTRIBUTING.md"}


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def site_anchors(text: str) -> str:
    """``text`` with links to its own headings' GitHub anchors (``#requests-over-nats---request-transport``)
    turned into the site's (``#requests-over-nats-request-transport``), so they work in both places."""
    from markdown.extensions.toc import slugify

    headings = [h for h in re.findall(r"^#{1,6} +(.+?) *$", text, re.M)]
    plain = {h: re.sub(r"[`*]", "", h) for h in headings}
    table = {github_slug(plain[h]): slugify(plain[h], "-") for h in headings}
    return re.sub(r"\]\(#([^)]+)\)", lambda m: f"](#{table.get(m.group(1), m.group(1))})", text)


def copied_page(source: Path) -> str:
    return site_anchors(source.read_text(encoding="utf-8"))


# -- the mkdocs hook ---------------------------------------------------------------------------------

def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    pages = [(CLI_PAGE, cli_markdown()), (METRICS_PAGE, metrics_markdown())]
    pages += [(path, copied_page(source)) for path, source in COPIED_PAGES.items()]
    for path, content in pages:
        existing = files.get_file_from_path(path)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, path, content=content))
    return files
