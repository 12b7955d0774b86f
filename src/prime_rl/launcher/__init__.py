"""The launcher, `uv run rl`: one config resolved into inference, orchestrator and trainer, launched
together, watched and stopped together (`supervisor.py`). The RL objective the trainer optimizes is
`trainer/rl/`; this package only starts processes."""
