"""``python -m infera.engine.atom``: an ATOM engine as a registered worker."""
from infera.engine.atom.adapter import AtomAdapter
from infera.engine.base.launcher import console_prog, launch


def main() -> None:
    """``python -m infera.engine.atom`` and the ``infera-atom`` console script."""
    launch(AtomAdapter(), console_prog("python -m infera.engine.atom"))


if __name__ == "__main__":
    main()
