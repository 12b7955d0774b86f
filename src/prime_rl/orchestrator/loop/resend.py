"""Which saved batches a restarted run sends again, read from the trainer's checkpoints.

Invariant: every step a restarted trainer may still train is re-sent (from its oldest kept
checkpoint, which it falls back to when the newest is damaged; a trainer further along skips the
extra ones), and nothing is re-sent to a trainer that has nothing left to train, which would never
read it.
"""

from __future__ import annotations

from pathlib import Path

from prime_rl.runtime.layout import checkpoint_root, complete_steps, verify_checkpoint


def oldest_resume_step(output_dir: Path, version: int) -> int:
    """The earliest step a restarted trainer may resume from: its oldest kept checkpoint, at most the
    served policy version; 0 if none. Batches from there on are kept on disk."""
    steps = complete_steps(checkpoint_root(output_dir))
    return min(steps[0] if steps else 0, version)


def trainer_is_done(output_dir: Path, max_steps: int) -> bool:
    """Whether the trainer's newest checkpoint is intact and at max_steps: restarted from it, the
    trainer trains and reads nothing (it was killed after its last checkpoint, before the run saw it
    finish)."""
    root = checkpoint_root(output_dir)
    steps = complete_steps(root)
    return bool(steps) and steps[-1] >= max_steps and verify_checkpoint(root / f"step_{steps[-1]}") is None


def steps_to_resend(output_dir: Path, next_step: int, version: int, max_steps: int) -> range:
    """The saved steps to send again before building `next_step`."""
    if trainer_is_done(output_dir, max_steps):
        return range(0)
    return range(oldest_resume_step(output_dir, version), next_step)
