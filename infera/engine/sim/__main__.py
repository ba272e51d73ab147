"""``python -m infera.engine.sim``: the simulated engine as a registered worker."""
from infera.engine.base.launcher import launch
from infera.engine.sim.launcher import SimAdapter

if __name__ == "__main__":
    launch(SimAdapter(), "python -m infera.engine.sim")
