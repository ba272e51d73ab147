"""The site's generated reference (docs/hooks/reference.py) cannot drift: every command is reached,
every flag and every metric has a description, and the server's metrics are the ones the
Observability page's table explains (tests/integration/test_metrics_docs.py checks that table
against a live server's /metrics)."""
from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_reference():
    spec = importlib.util.spec_from_file_location("docs_reference", REPO / "docs" / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_reference"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


ref = _load_reference()

@pytest.fixture(scope="module")
def entries():
    return ref.entry_points()


@pytest.fixture(scope="module")
def parsers(entries):
    return [(entry, word, parser) for entry in entries for word, parser in ref.parsers_of(entry)]


@pytest.fixture(scope="module")
def families():
    return ref.metric_families()


def _undocumented_flags(parsers) -> set[tuple[str, str]]:
    return {(entry.title + (f" {word}" if word else ""), flag.names[0])
            for entry, word, parser in parsers for flag in ref.flags_of(parser) if not flag.help.strip()}


# -- entry points ------------------------------------------------------------------------------------

def test_every_console_script_and_main_module_is_an_entry_point(entries):
    scripts = {s for e in entries for s in e.scripts}
    assert scripts == set(ref.console_scripts()), "a console script the reference does not show"
    modules = {e.module for e in entries if e.module}
    assert modules == set(ref.main_modules())
    assert {"infera.server", "infera.up", "infera.kvd", "infera.gaie", "infera.operator", "infera.engine.vllm",
            "infera.engine.sim", "infera.preflight"} <= modules
    # the python -m form and its console script run one function: one section, not two
    server = next(e for e in entries if e.module == "infera.server")
    assert server.scripts == ["infera-server"]


def test_every_entry_point_yields_its_parsers(parsers, entries):
    reached = {(e.title, word) for e, word, _ in parsers}
    assert {(e.title, "") for e in entries if e.module not in ref.SUBCOMMANDS} <= reached
    assert {("python -m infera.operator", "render"), ("python -m infera.operator", "run")} <= reached
    server = next(p for e, _, p in parsers if e.module == "infera.server")
    names = {n for f in ref.flags_of(server) for n in f.names}
    assert {"--router-policy", "--api-keys-file", "--max-inflight-per-worker", "--otlp-traces-endpoint"} <= names


def test_an_entry_point_that_never_parses_is_an_error(monkeypatch):
    module = type(sys)("fake_no_parser")
    module.main = lambda argv=None: 0
    monkeypatch.setitem(sys.modules, "fake_no_parser", module)
    with pytest.raises(LookupError, match="no argparse parser"):
        ref.parsers_of(ref.EntryPoint("fake_no_parser", "fake_no_parser:main"))


def test_capturing_a_parser_runs_nothing_past_it(monkeypatch):
    ran = []

    def main(argv=None):
        p = argparse.ArgumentParser(prog="fake")
        p.add_argument("--x", help="x")
        p.parse_args(argv)
        ran.append("past the parser")

    module = type(sys)("fake_main")
    module.main = main
    monkeypatch.setitem(sys.modules, "fake_main", module)
    [(word, parser)] = ref.parsers_of(ref.EntryPoint("fake_main", "fake_main:main"))
    assert word == "" and parser.prog == "fake" and ran == []


def test_a_module_without_main_is_refused(tmp_path, monkeypatch):
    (tmp_path / "fake_mainless.py").write_text('if __name__ == "__main__":\n    pass\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(LookupError, match="no main"):
        ref._target_of("fake_mainless")


# -- flags -------------------------------------------------------------------------------------------

def test_every_flag_has_a_description(parsers):
    missing = _undocumented_flags(parsers)
    assert not missing, f"flags without help text (add help=...): {sorted(missing)}"


def _parser(*specs):
    p = argparse.ArgumentParser(prog="t")
    for names, kwargs in specs:
        p.add_argument(*names, **kwargs)
    return p


@pytest.mark.parametrize("names, kwargs, expect", [
    (("--a",), {"default": 3, "help": "three [env INFERA_A]"}, (["--a"], "INFERA_A", "3", "three", False)),
    (("--b",), {"action": "store_true", "help": "a switch"}, (["--b"], "", "off", "a switch", False)),
    (("--c",), {"action": argparse.BooleanOptionalAction, "default": True, "help": "on by default"},
     (["--c", "--no-c"], "", "on", "on by default", False)),
    (("--d",), {"required": True, "help": "needed,  with   spaces\n folded"},
     (["--d"], "", "", "needed, with spaces folded", True)),
    (("--e",), {"default": 5, "help": "five (default %(default)s)"}, (["--e"], "", "5", "five (default 5)", False)),
    (("--f",), {"default": sys.executable, "help": "interpreter"}, (["--f"], "", "the current Python", "interpreter",
                                                                   False)),
    (("--g",), {"nargs": "+", "default": ["x", "y"], "help": "many"}, (["--g"], "", "x y", "many", False)),
    (("--h2",), {"help": ""}, (["--h2"], "", "", "", False)),
    (("--cache-bytes",), {"default": 64 << 20, "help": "a budget"}, (["--cache-bytes"], "", "64 MiB", "a budget",
                                                                      False)),
    (("--odd-bytes",), {"default": 1000, "help": "odd"}, (["--odd-bytes"], "", "1000", "odd", False)),
    (("--n",), {"default": 1 << 20, "help": "a count"}, (["--n"], "", "1048576", "a count", False)),
    (("--max-bytes",), {"default": 3159508992, "help": "a bound (default: 1/8 of this host's memory)"},
     (["--max-bytes"], "", "this host's (see meaning)", "a bound (default: 1/8 of this host's memory)", False)),
])
def test_flag_rows(names, kwargs, expect):
    [flag] = ref.flags_of(_parser((names, kwargs)))
    assert (flag.names, flag.env, flag.default, flag.help, flag.required) == expect


def test_hidden_flags_and_help_are_left_out():
    rows = ref.flags_of(_parser((("--shown",), {"help": "s"}), (("--hidden",), {"help": argparse.SUPPRESS})))
    assert [r.names for r in rows] == [["--shown"]]


def test_cli_markdown_escapes_table_cells(monkeypatch):
    p = _parser((("--pipe",), {"default": "a|b", "help": "x | y [env INFERA_PIPE]"}))
    entry = ref.EntryPoint("fake_pipe", "fake_pipe:main", ["fake-pipe"])
    monkeypatch.setattr(ref, "parsers_of", lambda e: [("", p)])
    text = ref.cli_markdown([entry])
    assert "## `python -m fake_pipe`" in text and "Console script: `fake-pipe`." in text
    assert "| `--pipe` | `INFERA_PIPE` | `a\\|b` | x \\| y |" in text


# -- metrics -----------------------------------------------------------------------------------------

def test_every_metric_has_a_description(families):
    assert set(families) >= {"server", "kvd"}
    missing = [(process, f.name) for process, fams in families.items() for f in fams if not f.help.strip()]
    assert not missing, f"metrics without a description: {missing}"


def test_metric_names_are_unique_per_process(families):
    for process, fams in families.items():
        names = [f.name for f in fams]
        assert len(names) == len(set(names)), process


def test_the_server_families_cover_every_optional_part(families):
    names = {f.name for f in families["server"]}
    for expected in ("infera_requests_total", "infera_kv_prompt_tokens_total", "infera_nats_connected",
                     "infera_replica_sync_peers", "infera_api_keys", "infera_tenant_rate_limited_total",
                     "infera_queue_waiting", "infera_server_processes", "infera_kv_window_engine_hit_rate",
                     "infera_http_connections"):
        assert expected in names
    kinds = {f.name: f.type for f in families["server"]}
    assert kinds["infera_requests_total"] == "counter" and kinds["infera_request_duration_seconds"] == "histogram"
    labels = {f.name: f.labels for f in families["server"]}
    assert labels["infera_requests_total"] == ["route", "status", "worker_id"]
    assert {f.name: f.labels for f in families["kvd"]}["infera_kvd_sets_total"] == ["reason"]


def test_the_observability_table_explains_every_server_metric(families):
    """The hand-written table (its meanings say more than a help line) and the registry agree."""
    text = (REPO / "docs" / "observability.md").read_text()
    section = text[text.index("## Metrics"):]
    table = set(re.findall(r"^\| `([a-z_:]+)` \|", section, re.M))
    registry = {f.name for f in families["server"]}
    assert not registry - table, f"in the registry, not in docs/observability.md: {sorted(registry - table)}"
    assert not table - registry, f"in docs/observability.md, not in the registry: {sorted(table - registry)}"


def test_metrics_markdown_lists_every_family(families):
    text = ref.metrics_markdown(families)
    for fams in families.values():
        for f in fams:
            assert f"| `{f.name}` | {f.type} |" in text


# -- copied pages ------------------------------------------------------------------------------------

@pytest.mark.parametrize("heading, github", [
    ("Requests over NATS (`--request-transport`)", "requests-over-nats---request-transport"),
    ("`router_overhead.py`: what the router costs", "router_overheadpy-what-the-router-costs"),
])
def test_github_anchors_become_site_anchors(heading, github):
    text = f"### {heading}\nsee [it](#{github}) and [elsewhere](other.md#{github})\n"
    out = ref.site_anchors(text)
    from markdown.extensions.toc import slugify

    assert f"](#{slugify(re.sub(r'[`*]', '', heading), '-')})" in out
    assert f"](other.md#{github})" in out  # only links to this page's own headings change


def test_copied_pages_exist():
    for source in ref.COPIED_PAGES.values():
        assert source.is_file()


# -- the README ---------------------------------------------------------------------------------------

def test_the_readme_is_a_front_page():
    """At most 150 lines, the two commands CI runs, and links that resolve (the pages it points at
    live in docs/, whose own links mkdocs build --strict checks)."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert re.search(r"^make run +# ", text, re.M) and re.search(r"^make test +# ", text, re.M)
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert "docs/index.md" in targets and "docs/reference/cli.md" not in targets  # generated: not in the repo
    for target in targets:
        if "://" not in target:
            assert (REPO / target).exists(), f"README links {target}, which does not exist"
