"""``python -m infera.engine.sglang``: an SGLang engine as a registered worker."""
from infera.engine.base.launcher import launch
from infera.engine.sglang.adapter import SglangAdapter

if __name__ == "__main__":
    launch(SglangAdapter(), "python -m infera.engine.sglang")
