"""Limits at the door (issue 11): JSON nesting/size without recursion, direct-mode roles, no prompts
in logs above debug."""
from __future__ import annotations

import ast
import json
import pathlib
from typing import Union

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from infera.api.errors import ApiError
from infera.api.requests import MAX_JSON_DEPTH, json_structure_problem, parse_request
from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.router.auto import AutoRouter
from infera.router.policy import RoutedRequest



def reference_depth(b: bytes) -> int:
    """Deepest nesting a left-to-right reader reaches (strings and their escapes skipped)."""
    depth = best = 0
    i, in_string = 0, False
    while i < len(b):
        c = b[i]
        if in_string:
            if c == 0x5C:  # backslash: the next byte is escaped
                i += 2
                continue
            in_string = c != 0x22
        elif c == 0x22:
            in_string = True
        elif c in b"[{":
            depth += 1
            best = max(best, depth)
        elif c in b"]}":
            depth -= 1
        i += 1
    return best


def bounded_decoder(limit: int) -> msgspec.json.Decoder:
    """msgspec's own reading of "at most ``limit`` levels" (the type tree grows 2^limit: small limits only)."""
    t = Union[None, bool, int, float, str]
    for _ in range(limit):
        t = Union[None, bool, int, float, str, list[t], dict[str, t]]  # type: ignore[valid-type]
    return msgspec.json.Decoder(t)


BOUNDED = {n: bounded_decoder(n) for n in range(1, 6)}
TRICKY = '[]{}"\\abnu/'
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet=TRICKY, max_size=6),
    lambda inner: (st.lists(inner, max_size=3)
                   | st.dictionaries(st.text(alphabet=TRICKY, max_size=4), inner, max_size=3)),
    max_leaves=40)


@settings(max_examples=400)
@given(json_values, st.integers(1, 8))
def test_depth_is_exact_on_valid_json(value, limit):
    body = json.dumps(value).encode()
    assert (json_structure_problem(body, limit) is not None) == (reference_depth(body) > limit), body


@settings(max_examples=1500)
@given(st.binary(max_size=60).map(lambda raw: bytes(b'[]{}"\\an,:1 '[c % 12] for c in raw)), st.integers(1, 5))
def test_never_misses_what_a_decoder_would_descend_into(body, limit):
    """Invalid JSON included: if the check lets a body through, msgspec never meets a container
    deeper than the limit before it stops (at the end, or at the first syntax error)."""
    if json_structure_problem(body, limit) is None:
        try:
            BOUNDED[limit].decode(body)
        except msgspec.ValidationError as exc:
            pytest.fail(f"{body!r} passed the depth-{limit} check but nests deeper: {exc}")
        except msgspec.DecodeError:
            pass


@pytest.mark.parametrize("body, problem", [
    (b"[" * 64 + b"]" * 64, None),
    (b"[" * 65 + b"]" * 65, "deeper than 64"),
    (b"[" * 65, "deeper than 64"),  # unterminated: a decoder still descends
    (b"]" * 1000, None),  # garbage, but shallow: msgspec's own 400
    (b'["' + b"[" * 1000 + b'"]', None),  # text
    (b'["\\"' + b"[" * 1000 + b'"]', None),  # an escaped quote does not end the string
    (b'["\\\\"' + b"[" * 65 + b"]" * 65 + b"]", "deeper than 64"),  # an escaped backslash does not hide the quote
    (b'[' + b'"[",' * 200 + b'"x"]', None),
    (b"[" + b",".join([b"{}"] * 100_001) + b"]", "more than 100000"),
])
def test_structure_table(body, problem):
    got = json_structure_problem(body)
    assert (got is None) if problem is None else (problem in got)


def test_normal_and_long_requests_pass_the_check():
    # What it costs is measured by bench/request_limits.py (~1 µs for this body, ~120 µs for the
    # 45 KB 100-message conversation): timing bounds do not belong in a unit test on a shared box.
    normal = json.dumps({"model": "m", "stream": True, "max_tokens": 64,
                         "messages": [{"role": "system", "content": "You are helpful. " * 20},
                                      {"role": "user", "content": "Hello there, how are you? " * 10}]}).encode()
    long_chat = json.dumps({"model": "m", "messages": [
        {"role": "user", "content": "def f(x):\n    return {'a': [x]}  # \"q\" " * 10} for _ in range(100)]}).encode()
    assert json_structure_problem(normal) is None
    assert json_structure_problem(long_chat) is None
    assert parse_request("/v1/chat/completions", long_chat).model == "m"


@pytest.mark.parametrize("make_body, problem", [  # built in the test: not held for the whole session
    (lambda: b"[" * (8 << 20) + b"]" * (8 << 20), "more than 100000"),  # 8 Mi levels: counted, never recursed
    (lambda: b"[" + b",".join([b"[" * 60 + b"]" * 60] * 60000) + b"]", "more than 100000"),
    (lambda: b"[" + b'"[",' * (2 << 20) + b'""]', None),  # 2 Mi strings holding a bracket: text, one array
], ids=["deep", "many-nested", "strings"])
def test_worst_case_bodies_get_an_answer(make_body, problem):
    """The worst bodies within the 32 MiB cap get the right answer without recursion (their cost, a
    few linear passes, is measured by bench/request_limits.py)."""
    got = json_structure_problem(make_body())
    assert (got is None) if problem is None else (problem in got)


# -- direct mode checks roles (item 3) ---------------------------------------------------------------

class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def dispatch(self, req):
        self.calls.append(("dispatch", req.direct_worker))
        return "mixed-reply"

    async def dispatch_pair(self, req, prefill, decode):
        self.calls.append(("pair", prefill.worker_id, decode.worker_id))
        return "pair-reply"


def _fleet() -> Fleet:
    fleet = Fleet()
    for wid, mode in (("mix", "mixed"), ("pre", "prefill"), ("dec", "decode")):
        fleet.upsert(WorkerRecord(worker_id=wid, url=f"http://{wid}", model_name="m", disagg_mode=mode))
    return fleet


def _req(worker=None, prefill=None) -> RoutedRequest:
    return RoutedRequest(route="/v1/chat/completions", body=b"{}", parsed=None, model="m", stream=False,
                         request_id="r", direct_worker=worker, direct_prefill=prefill)


@pytest.mark.parametrize("worker, prefill, outcome", [
    ("mix", None, ("dispatch", "mix")),
    ("dec", "pre", ("pair", "pre", "dec")),
    ("dec", None, "is a decode worker"),  # today: sent the client's body (and its kv_transfer_params) to the decode
    ("pre", None, "is a prefill worker"),
    ("pre", "pre", "not decode"),  # a prefill named as the decode
    ("mix", "pre", "not decode"),
    ("dec", "dec", "not prefill"),
    ("gone", None, ("dispatch", "gone")),  # unknown: MixedRouter's 503 (stale gateway routing)
])
async def test_direct_mode_checks_the_pinned_roles(worker, prefill, outcome):
    mixed, disagg = _Recorder(), _Recorder()
    router = AutoRouter(_fleet(), mixed, disagg, direct=True)  # type: ignore[arg-type]
    if isinstance(outcome, tuple):
        await router.dispatch(_req(worker, prefill))
        assert (mixed.calls + disagg.calls) == [outcome]
        return
    with pytest.raises(ApiError) as info:
        await router.dispatch(_req(worker, prefill))
    assert info.value.status == 400 and info.value.code == "worker_role_mismatch" and outcome in info.value.message
    assert mixed.calls == disagg.calls == []


async def test_auto_mode_ignores_the_pinning_headers():
    mixed, disagg = _Recorder(), _Recorder()
    fleet = Fleet()
    fleet.upsert(WorkerRecord(worker_id="mix", url="http://mix", model_name="m"))
    await AutoRouter(fleet, mixed, disagg, direct=False).dispatch(_req("dec"))  # type: ignore[arg-type]
    assert mixed.calls == [("dispatch", "dec")]  # MixedRouter only honours it under direct


# -- prompts never logged above debug (item 4) -------------------------------------------------------

# Names that hold a request's text or tokens; a logging call above debug must not format them.
PROMPT_NAMES = {"body", "prompt", "prompts", "messages", "content", "parsed", "token_ids"}
ALLOWED = {"info.state.messages"}  # a JetStream message count


def test_no_prompt_is_logged_above_debug():
    root = pathlib.Path(__file__).resolve().parents[2] / "infera"
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("info", "warning", "error", "exception", "critical")
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in ("log", "logger", "logging")):
                continue
            for arg in [*node.args[1:], *(k.value for k in node.keywords)]:
                for sub in ast.walk(arg):
                    name = sub.attr if isinstance(sub, ast.Attribute) else getattr(sub, "id", None)
                    if name in PROMPT_NAMES and ast.unparse(sub) not in ALLOWED:
                        offenders.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)[:120]}")
    assert not offenders, "request content logged above debug:\n" + "\n".join(offenders)


def test_max_depth_default():
    assert MAX_JSON_DEPTH == 64


class _CountingDisagg(_Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.failures: list[str] = []
        self.metrics = self

    def count_pd_bootstrap_failure(self, reason: str) -> None:
        self.failures.append(reason)


@pytest.mark.parametrize("worker, prefill, status, counted", [
    ("dec", "gone", 503, ["direct_worker_missing"]),  # the named prefill is not in the fleet
    ("gone", "pre", 503, ["direct_worker_missing"]),  # nor the named decode
    ("pre", "pre", 400, []),  # present but the wrong role: the client's mistake, not a missing worker
])
async def test_direct_pair_counts_a_missing_worker_as_the_reference_does(worker, prefill, status, counted):
    mixed, disagg = _Recorder(), _CountingDisagg()
    router = AutoRouter(_fleet(), mixed, disagg, direct=True)  # type: ignore[arg-type]
    with pytest.raises(ApiError) as info:
        await router.dispatch(_req(worker, prefill))
    assert info.value.status == status and disagg.failures == counted and disagg.calls == []
