"""``python -m infera.engine.atom``: an ATOM engine as a registered worker."""
from infera.engine.atom.adapter import AtomAdapter
from infera.engine.base.launcher import launch

if __name__ == "__main__":
    launch(AtomAdapter(), "python -m infera.engine.atom")
