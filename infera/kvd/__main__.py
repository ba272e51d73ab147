"""``python -m infera.kvd``: run the daemon until SIGTERM/SIGINT."""
from __future__ import annotations

import asyncio
import logging
import sys
from typing import Sequence

from infera.kvd.config import parse_args
from infera.kvd.server import SocketInUse, run


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(run(config))
    except SocketInUse as e:
        print(f"infera-kvd: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"infera-kvd: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
