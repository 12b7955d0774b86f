"""The trainer on a GPU it does not have: the fake-GPU dry run of the real step and the memory plan
per GPU (`plan-memory`)."""
