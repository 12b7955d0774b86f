"""The trainer on a GPU it does not have: the dry run of the real step (on `parallel/fake_gpu.py`)
and the memory plan per GPU (`plan-memory`). These drive the trainer from above; the fake device
itself stands below the model."""
