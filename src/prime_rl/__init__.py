"""prime_rl: asynchronous RL post-training for language models."""
