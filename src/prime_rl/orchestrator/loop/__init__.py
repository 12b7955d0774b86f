"""The orchestrator's loop: scheduling, accounting, the pipeline from groups to batches, progress,
weights and server health. It never imports the env side (`prime_rl.orchestrator.envs`): it reaches
it through the message types of `prime_rl.orchestrator.messages`, in process or in env workers."""
