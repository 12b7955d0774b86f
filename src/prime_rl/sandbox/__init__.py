"""Run what an env executes on the model's behalf (code, commands, tools) in a local sandbox:
bubblewrap namespaces (no network, a read-only view of what it needs, a scratch folder), a user of
its own, rlimits, a wall-clock deadline and an output cap (`run.py`)."""
