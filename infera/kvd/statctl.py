"""``python -m infera.kvd.statctl``: print the daemon's stats as JSON; exit 1 on a connection or
protocol error. A healthy daemon that served traffic shows sets_total, gets_total, hits_total > 0."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from infera.kvd.client import KvdError, SyncKvdClient, default_socket_path
from infera.kvd.protocol import ProtocolError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infera.kvd.statctl", description=__doc__)
    parser.add_argument("--socket", default=None, help="daemon socket [env INFERA_KVD_SOCKET, else the default]")
    parser.add_argument("--client-id", default="statctl", help="the client id this tool sends in its Hello to the daemon")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds for connect and each reply")
    a = parser.parse_args(argv)
    path = a.socket or default_socket_path()
    try:
        with SyncKvdClient(path, client_id=a.client_id, timeout=a.timeout) as client:
            stats = client.stats()
    except (OSError, KvdError, ProtocolError) as e:
        print(f"statctl: {path}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
