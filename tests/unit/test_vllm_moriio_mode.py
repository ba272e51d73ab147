"""MoRIIO read vs write mode from the engine's own config, as vLLM 0.32 decides it
(``moriio_common.get_moriio_mode``: ``kv_connector_extra_config.read_mode``; the env
``VLLM_MORIIO_CONNECTOR_READ_MODE`` is deprecated and ignored)."""
from __future__ import annotations

import logging

import pytest

from infera.engine.vllm.adapter import disaggregation, moriio_read_mode


def mori(role: str = "kv_producer", **extra) -> dict:
    cfg = {"kv_connector": "MoRIIOConnector", "kv_role": role, "engine_id": "e"}
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return cfg


@pytest.mark.parametrize(
    "extra, read",
    [
        ({}, False),
        ({"read_mode": "true"}, True),
        ({"read_mode": "True "}, True),
        ({"read_mode": "1"}, True),
        ({"read_mode": True}, True),  # str(True) == "True"
        ({"read_mode": 1}, True),
        ({"read_mode": "false"}, False),
        ({"read_mode": "0"}, False),
        ({"read_mode": "yes"}, False),  # vLLM takes only "true"/"1"
        ({"read_mode": False}, False),
        ({"read_mode": None}, False),
    ],
)
def test_read_mode_from_the_connector_extra_config(extra, read):
    assert moriio_read_mode(mori(**extra)) is read
    for role, mode in (("kv_producer", "prefill"), ("kv_consumer", "decode")):
        got_mode, meta = disaggregation(mori(role, **extra), "10.0.0.5")
        assert got_mode == mode
        assert meta["protocol"] == ("vllm-mori-read" if read else "vllm-mori-write")


@pytest.mark.parametrize("value", ["1", "true"])
def test_the_deprecated_env_decides_nothing_and_is_called_out(monkeypatch, caplog, value):
    monkeypatch.setenv("VLLM_MORIIO_CONNECTOR_READ_MODE", value)
    with caplog.at_level(logging.WARNING, logger="infera.launcher.vllm"):
        _, meta = disaggregation(mori(), "10.0.0.5")
    assert meta["protocol"] == "vllm-mori-write"
    assert "kv_connector_extra_config" in caplog.text
    _, meta = disaggregation(mori(read_mode="true"), "10.0.0.5")
    assert meta["protocol"] == "vllm-mori-read"


def test_read_mode_of_a_wrapped_connector_is_its_own():
    """Inside a MultiConnector vLLM builds each child from its own config: the child's read_mode counts."""
    child = {"kv_connector": "MoRIIOConnector", "kv_connector_extra_config": {"read_mode": "true"}}
    cfg = {"kv_connector": "MultiConnector", "kv_role": "kv_consumer", "engine_id": "e",
           "kv_connector_extra_config": {"connectors": [child, {"kv_connector": "LMCacheConnectorV1"}]}}
    assert disaggregation(cfg, "10.0.0.5")[1]["protocol"] == "vllm-mori-read"
    child["kv_connector_extra_config"] = {}
    assert disaggregation(cfg, "10.0.0.5")[1]["protocol"] == "vllm-mori-write"


def test_no_warning_without_the_env_or_for_other_connectors(monkeypatch, caplog):
    monkeypatch.delenv("VLLM_MORIIO_CONNECTOR_READ_MODE", raising=False)
    with caplog.at_level(logging.WARNING, logger="infera.launcher.vllm"):
        disaggregation(mori(), "10.0.0.5")
    monkeypatch.setenv("VLLM_MORIIO_CONNECTOR_READ_MODE", "1")
    with caplog.at_level(logging.WARNING, logger="infera.launcher.vllm"):
        disaggregation({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}, "10.0.0.5")
    assert "VLLM_MORIIO_CONNECTOR_READ_MODE" not in caplog.text
