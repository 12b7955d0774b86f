"""The orchestrator: schedules rollouts, groups them, computes advantages, streams micro-batches."""
