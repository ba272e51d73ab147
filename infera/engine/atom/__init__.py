"""ATOM workers: ``python -m infera.engine.atom <infera flags> <atom openai_server flags>``."""
