"""The env side: verifiers envs, the group runner, the inference clients, rewards, reward models and
the teacher. It runs in the orchestrator process or in env workers, and never imports the loop."""
