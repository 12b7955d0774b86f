"""Inference: vLLM's OpenAI-compatible server, plus a narrow route to reload weights in place; its
config (`config.py`, the `[inference]` section) is the one the orchestrator's engine mode reads too."""
