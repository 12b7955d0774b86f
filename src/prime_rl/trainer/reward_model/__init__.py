"""Reward-model training (`uv run train-reward-model`): a scalar head on pairs of answers."""
