"""Supervised fine-tuning (`uv run sft`): the trainer's machinery with a cross-entropy loss."""
