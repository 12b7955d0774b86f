"""`uv run rl`: one config resolved into inference, orchestrator and trainer, launched together."""
