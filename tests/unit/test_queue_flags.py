"""The admission queue's flags: the reserve must leave slots open to every tenant, and needs the
per-worker bound it is a share of; a bad pair stops the server at parse time with both flags named."""
from __future__ import annotations

import pytest

from infera.server.cli import parse_args


@pytest.mark.parametrize("argv, env, reserve", [
    ([], {}, 0),
    (["--max-inflight-per-worker", "4", "--queue-reserve-per-worker", "1"], {}, 1),
    (["--max-inflight-per-worker", "4"], {"INFERA_QUEUE_RESERVE_PER_WORKER": "3"}, 3),
    (["--max-inflight-per-worker", "4", "--queue-reserve-per-worker", "2"],
     {"INFERA_QUEUE_RESERVE_PER_WORKER": "3"}, 2),
])
def test_reserve_flag_env_default(argv, env, reserve):
    assert parse_args(["--etcd-endpoint", "h", *argv], environ=env).queue_reserve_per_worker == reserve


@pytest.mark.parametrize("argv", [
    ["--max-inflight-per-worker", "2", "--queue-reserve-per-worker", "2"],  # nothing left open
    ["--max-inflight-per-worker", "2", "--queue-reserve-per-worker", "5"],
    ["--queue-reserve-per-worker", "1"],  # no per-worker bound to take a share of
    ["--max-inflight-per-worker", "2", "--queue-reserve-per-worker", "-1"],
])
def test_reserve_refused_with_both_flags_named(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--etcd-endpoint", "h", *argv], environ={})
    err = capsys.readouterr().err
    assert "--queue-reserve-per-worker" in err
