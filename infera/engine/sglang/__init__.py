"""SGLang workers: ``python -m infera.engine.sglang <infera flags> <sglang launch_server flags>``."""
