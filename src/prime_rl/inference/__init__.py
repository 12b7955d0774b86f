"""Inference: vLLM's OpenAI-compatible server, plus a narrow route to reload weights in place."""
