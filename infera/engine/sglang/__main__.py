"""``python -m infera.engine.sglang``: an SGLang engine as a registered worker."""
from infera.engine.base.launcher import console_prog, launch
from infera.engine.sglang.adapter import SglangAdapter


def main() -> None:
    """``python -m infera.engine.sglang`` and the ``infera-sglang`` console script."""
    launch(SglangAdapter(), console_prog("python -m infera.engine.sglang"))


if __name__ == "__main__":
    main()
