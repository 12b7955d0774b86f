"""The trainer: receives micro-batches, trains the policy, checkpoints and publishes weights."""
