"""``python -m infera.engine.vllm``: a vLLM engine as a registered worker."""
from infera.engine.base.launcher import console_prog, launch
from infera.engine.vllm.adapter import VllmAdapter


def main() -> None:
    """``python -m infera.engine.vllm`` and the ``infera-vllm`` console script."""
    launch(VllmAdapter(), console_prog("python -m infera.engine.vllm"))


if __name__ == "__main__":
    main()
