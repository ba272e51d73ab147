"""Infera: a routed fleet of LLM engines behind one OpenAI-compatible endpoint."""
__version__ = "0.1.0"
