"""The RL objective: what the trainer's step optimizes in an RL run (`trainer.main`), from token-level
credit (credit, critic, KL in the reward) to the loss normalized over the global batch (trainer).
Not the `rl` command, which only launches the processes (`prime_rl.launcher`)."""
