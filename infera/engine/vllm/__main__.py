"""``python -m infera.engine.vllm``: a vLLM engine as a registered worker."""
from infera.engine.base.launcher import launch
from infera.engine.vllm.adapter import VllmAdapter

if __name__ == "__main__":
    launch(VllmAdapter(), "python -m infera.engine.vllm")
