"""The trainer's weights leaving it: checkpoints, published weights for inference (files or a
collective broadcast), LoRA adapter export."""
