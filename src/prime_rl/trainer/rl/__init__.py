"""The RL step: token-level credit (credit, returns, critic, KL in the reward) and the optimizer
step with the loss normalized over the global batch (trainer)."""
