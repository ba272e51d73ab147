"""``python -m infera.engine.sim``: the simulated engine as a registered worker."""
from infera.engine.base.launcher import console_prog, launch
from infera.engine.sim.launcher import SimAdapter


def main() -> None:
    """``python -m infera.engine.sim`` and the ``infera-sim`` console script."""
    launch(SimAdapter(), console_prog("python -m infera.engine.sim"))


if __name__ == "__main__":
    main()
