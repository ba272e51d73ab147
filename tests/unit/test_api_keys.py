"""--api-keys-file: the file's validation (each mistake named by entry and field), how a client's
key is found (Bearer or x-api-key), 401/403, reloads (a change swaps the keys; a broken file keeps
the old ones), per-tenant counting with bounded labels."""
from __future__ import annotations

import hashlib
import json
import os

import pytest

from infera.api.errors import ApiError
from infera.server.api_keys import ApiKeys, ApiKeysError, ApiKeysMetrics, parse_keys, presented_key


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


GOOD = f"""
keys:
  - sha256: {sha("key-a")}
    tenant: team-a
    models: ["*"]
  - sha256: {sha("key-b").upper()}
    tenant: team-b
    models: [small, large]
  - sha256: {sha("key-c")}
    tenant: team-c
"""


def test_a_valid_file_maps_digests_to_tenants_and_models():
    keys = parse_keys(GOOD)
    by_tenant = {k.tenant: k for k in keys.values()}
    assert set(by_tenant) == {"team-a", "team-b", "team-c"}
    assert by_tenant["team-a"].models is None and by_tenant["team-c"].models is None  # "*" and absent: every model
    assert by_tenant["team-b"].models == frozenset({"small", "large"})
    assert bytes.fromhex(sha("key-b")) in keys  # upper-case hex is the same digest


def test_limits_are_per_tenant_and_shared_by_its_keys():
    from infera.server.tenant_limits import TenantLimit

    text = f"""keys:
  - {{sha256: {sha('a1')}, tenant: a, requests_per_minute: 60, tokens_per_minute: 1000, max_concurrent: 2}}
  - {{sha256: {sha('a2')}, tenant: a, requests_per_minute: 60, tokens_per_minute: 1000, max_concurrent: 2}}
  - {{sha256: {sha('b')}, tenant: b}}
"""
    keys = {k.tenant + str(i): k for i, k in enumerate(parse_keys(text).values())}
    assert keys["a0"].limit == keys["a1"].limit == TenantLimit(60, 1000, 2)
    assert not keys["b2"].limit  # no limit: nothing to admit against


def test_json_is_valid_yaml():
    doc = {"keys": [{"sha256": sha("k"), "tenant": "t1", "models": ["m"]}]}
    assert [k.tenant for k in parse_keys(json.dumps(doc)).values()] == ["t1"]


@pytest.mark.parametrize("text, says", [
    ("keys: [", "not valid YAML at line"),
    ("[]", "exactly one field, 'keys'"),
    ("keys: {}", "exactly one field, 'keys'"),
    ("keys: []\nextra: 1", "exactly one field, 'keys'"),
    ("keys: [1]", "keys[0]: expected a mapping"),
    (f"keys: [{{sha256: {sha('k')}, tenant: t, colour: red}}]", "keys[0]: unknown field 'colour'"),
    ("keys: [{sha256: abc, tenant: t}]", "keys[0].sha256: expected the key's sha256"),
    ("keys: [{tenant: t}]", "keys[0].sha256"),
    (f"keys: [{{sha256: {sha('k')}}}]", "keys[0].tenant"),
    (f"keys: [{{sha256: {sha('k')}, tenant: 'has space'}}]", "keys[0].tenant"),
    (f"keys: [{{sha256: {sha('k')}, tenant: other}}]", "keys[0].tenant"),  # reserved for unknown tenants
    (f"keys: [{{sha256: {sha('k')}, tenant: t, models: []}}]", "keys[0].models"),
    (f"keys: [{{sha256: {sha('k')}, tenant: t, models: small}}]", "keys[0].models"),
    (f"keys: [{{sha256: {sha('k')}, tenant: t, models: ['']}}]", "keys[0].models"),
    (f"keys: [{{sha256: {sha('k')}, tenant: a}}, {{sha256: {sha('k')}, tenant: b}}]", "keys[1].sha256: the same key"),
    (f"keys: [{{sha256: {sha('k')}, tenant: t, requests_per_minute: 0}}]", "keys[0].requests_per_minute: expected"),
    (f"keys: [{{sha256: {sha('k')}, tenant: t, tokens_per_minute: '100'}}]", "keys[0].tokens_per_minute: expected"),
    (f"keys: [{{sha256: {sha('k')}, tenant: t, max_concurrent: true}}]", "keys[0].max_concurrent: expected"),
    (f"keys: [{{sha256: {sha('k')}, tenant: t, max_concurrent: 2.5}}]", "keys[0].max_concurrent: expected"),
    (f"keys: [{{sha256: {sha('a')}, tenant: t, requests_per_minute: 5}}, {{sha256: {sha('b')}, tenant: t}}]",
     "keys[1]: tenant 't' has other limits in keys[0]"),
    (f"keys: [{{sha256: {sha('k')}, tenant: t, priority: high}}]", "keys[0].priority: expected a whole number"),
    (f"keys: [{{sha256: {sha('k')}, tenant: t, priority: 5000}}]", "keys[0].priority: expected a whole number"),
    (f"keys: [{{sha256: {sha('k')}, tenant: t, weight: 0}}]", "keys[0].weight: expected a number from 1/64 to 64"),
    (f"keys: [{{sha256: {sha('k')}, tenant: t, weight: 65}}]", "keys[0].weight: expected a number"),
    (f"keys: [{{sha256: {sha('k')}, tenant: t, weight: true}}]", "keys[0].weight: expected a number"),
    (f"keys: [{{sha256: {sha('k')}, tenant: t, weight: '2'}}]", "keys[0].weight: expected a number"),
    (f"keys: [{{sha256: {sha('a')}, tenant: t, weight: 2}}, {{sha256: {sha('b')}, tenant: t}}]",
     "keys[1]: tenant 't' has another weight in keys[0]"),
    (f"keys: [{{sha256: {sha('k')}, tenant: t, cache_isolation: 'yes'}}]", "keys[0].cache_isolation: expected"),
    (f"keys: [{{sha256: {sha('a')}, tenant: t, cache_isolation: true}}, {{sha256: {sha('b')}, tenant: t}}]",
     "keys[1]: tenant 't' sets another cache_isolation in keys[0]"),
    (f"keys: [{{sha256: {sha('k')}, tenant: t}}]\ncache_salt_secret: short", "cache_salt_secret: expected"),
])
def test_every_mistake_is_named_by_entry_and_field(text, says):
    with pytest.raises(ApiKeysError) as err:
        parse_keys(text)
    assert says in str(err.value)
    assert "key-" not in str(err.value)


@pytest.mark.parametrize("headers, key", [
    ({"Authorization": "Bearer k1"}, "k1"),
    ({"Authorization": "bearer  k1 "}, "k1"),
    ({"x-api-key": "k2"}, "k2"),
    ({"Authorization": "Bearer k1", "x-api-key": "k2"}, "k1"),  # Bearer first
    ({"Authorization": "Basic abc", "x-api-key": "k2"}, "k2"),
    ({"Authorization": "Bearer "}, None),
    ({}, None),
])
def test_presented_key(headers, key):
    assert presented_key(headers) == key


def keys_file(tmp_path, text: str = GOOD) -> ApiKeys:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    keys = ApiKeys(str(path))
    keys.load()
    return keys


def test_authenticate_and_authorize(tmp_path):
    keys = keys_file(tmp_path)
    assert keys.authenticate({"Authorization": "Bearer key-a"}).tenant == "team-a"
    assert keys.authenticate({"x-api-key": "key-b"}).tenant == "team-b"
    for headers, code in (({}, "missing_api_key"), ({"x-api-key": "nope"}, "invalid_api_key"),
                          ({"Authorization": "Bearer key-a2"}, "invalid_api_key")):
        with pytest.raises(ApiError) as err:
            keys.authenticate(headers)
        assert err.value.status == 401 and err.value.code == code and "WWW-Authenticate" in err.value.headers
        assert "key-a" not in err.value.message
    b = keys.authenticate({"x-api-key": "key-b"})
    keys.authorize(b, "small")
    with pytest.raises(ApiError) as err:
        keys.authorize(b, "medium")
    assert err.value.status == 403 and err.value.code == "model_not_allowed" and err.value.param == "model"
    keys.authorize(keys.authenticate({"x-api-key": "key-a"}), "anything")
    assert keys.rejected == {"missing": 1, "invalid": 2, "model": 1}


def test_a_bad_file_at_start_is_an_error_naming_why(tmp_path):
    with pytest.raises(ApiKeysError, match="cannot read it"):
        ApiKeys(str(tmp_path / "absent.yaml")).load()
    with pytest.raises(ApiKeysError, match="keys\\[0\\]"):
        keys_file(tmp_path, "keys: [1]")


async def test_reload_swaps_keys_on_change_and_keeps_them_when_the_new_file_is_broken(tmp_path):
    keys = keys_file(tmp_path)
    path = tmp_path / "keys.yaml"
    assert not await keys.reload_if_changed()  # unchanged: nothing read
    # a Secret update: a new file swapped in (new inode)
    new = tmp_path / "keys.new"
    new.write_text(f"keys: [{{sha256: {sha('key-z')}, tenant: team-z}}]")
    os.replace(new, path)
    assert await keys.reload_if_changed()
    assert keys.authenticate({"x-api-key": "key-z"}).tenant == "team-z"
    with pytest.raises(ApiError):
        keys.authenticate({"x-api-key": "key-a"})  # the old key is gone
    broken = tmp_path / "keys.broken"
    broken.write_text("keys: [")
    os.replace(broken, path)
    assert not await keys.reload_if_changed()
    assert keys.reload_failures == 1 and keys.reloads == 1
    assert keys.authenticate({"x-api-key": "key-z"}).tenant == "team-z"  # still in force
    path.unlink()
    assert not await keys.reload_if_changed()  # gone: kept too
    assert keys.reload_failures == 2


async def test_the_watch_task_reloads_by_itself(tmp_path):
    from tests.conftest import wait_for

    keys = keys_file(tmp_path)
    keys.poll_s = 0.02
    keys.start()
    try:
        new = tmp_path / "keys.new"
        new.write_text(f"keys: [{{sha256: {sha('key-w')}, tenant: team-w}}]")
        os.replace(new, tmp_path / "keys.yaml")
        await wait_for(lambda: keys.reloads == 1, 5, message="the watch reloaded the file")
        assert keys.authenticate({"x-api-key": "key-w"}).tenant == "team-w"
    finally:
        await keys.stop()
    assert keys._task is None


def test_tenant_counts_have_bounded_labels(tmp_path):
    keys = keys_file(tmp_path)
    keys.count("team-a", 200)
    keys.count("team-a", 403)
    keys.count("team-a", 503)
    keys.count("gone-tenant", 200)  # no longer in the file: "other"
    assert keys.requests == {("team-a", "2xx"): 1, ("team-a", "4xx"): 1, ("team-a", "5xx"): 1, ("other", "2xx"): 1}
    families = {f.name: f for f in ApiKeysMetrics(keys).collect()}
    assert families["infera_api_keys"].samples[0].value == 3
    tenants = {(s.labels["tenant"], s.labels["code"]): s.value for s in families["infera_tenant_requests"].samples
               if s.name.endswith("_total")}
    assert tenants[("other", "2xx")] == 1 and tenants[("team-a", "5xx")] == 1


def test_the_server_refuses_to_start_on_a_bad_file_and_the_picker_refuses_the_flag(tmp_path, capsys):
    from infera.gaie.cli import parse_args as parse_epp_args
    from infera.server.cli import parse_args

    bad = tmp_path / "keys.yaml"
    bad.write_text("keys: [{tenant: t}]")
    etcd = ["--etcd-endpoint", "127.0.0.1:2379"]
    with pytest.raises(SystemExit):
        parse_args([*etcd, "--api-keys-file", str(bad)], environ={})
    assert "--api-keys-file" in (err := capsys.readouterr().err) and "keys[0].sha256" in err
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    assert parse_args(etcd, environ={"INFERA_API_KEYS_FILE": str(good)}).api_keys_file == str(good)  # env works
    with pytest.raises(SystemExit):  # the gateway authenticates; the picker serves no HTTP API
        parse_epp_args([*etcd, "--api-keys-file", str(good)], environ={})
    assert "unrecognized arguments: --api-keys-file" in capsys.readouterr().err


@pytest.mark.parametrize("entry, weight", [
    ("", 1.0),            # absent: every tenant alike
    (", weight: 3", 3.0),
    (", weight: 0.5", 0.5),
    (", weight: 64", 64.0),
    (", weight: 0.015625", 1 / 64),
])
def test_a_tenants_weight_is_read(entry, weight):
    (key,) = parse_keys(f"keys: [{{sha256: {sha('k')}, tenant: t{entry}}}]").values()
    assert key.weight == weight
