"""Turn rollouts into training samples.

Invariant: a sample's tokens are exactly the tokens the server saw and sampled (never re-tokenized
text). Multi-turn: when a turn's prompt extends the previous prompt plus completion, the turns merge
into one sample and the tokens in between (env or tool messages) get loss mask 0 and logprob 0;
a turn that does not extend the previous one starts a new sample.
"""

from __future__ import annotations

from prime_rl.orchestrator.rollout import Rollout
from prime_rl.transport.messages import TrainingSample


def _extends(prefix: list[int], ids: list[int]) -> bool:
    return len(ids) >= len(prefix) and ids[: len(prefix)] == prefix


def rollout_to_samples(rollout: Rollout, temperature: float = 1.0) -> list[TrainingSample]:
    assert rollout.advantage is not None, "advantages are computed before samples are built"
    samples: list[TrainingSample] = []
    context: list[int] = []  # prompt + completion so far of the current sample
    for turn in rollout.turns:
        if samples and _extends(context, turn.prompt_ids):
            sample = samples[-1]
            inserted = turn.prompt_ids[len(context) :]
            sample.completion_ids += inserted + turn.completion_ids
            sample.completion_mask += [0] * len(inserted) + turn.completion_mask
            sample.completion_logprobs += [0.0] * len(inserted) + turn.completion_logprobs
        else:
            samples.append(
                TrainingSample(
                    prompt_ids=list(turn.prompt_ids),
                    completion_ids=list(turn.completion_ids),
                    completion_mask=list(turn.completion_mask),
                    completion_logprobs=list(turn.completion_logprobs),
                    advantage=rollout.advantage,
                    reward=rollout.reward,
                    env_name=rollout.env_name,
                    example_id=rollout.example_id,
                    policy_version=rollout.policy_version,
                    temperature=temperature,
                )
            )
        context = turn.prompt_ids + turn.completion_ids
    return samples


def sample_lengths(rollout: Rollout) -> list[int]:
    """Token counts of the samples `rollout_to_samples` would build, without building them."""
    lengths: list[int] = []
    context: list[int] = []
    for turn in rollout.turns:
        if lengths and _extends(context, turn.prompt_ids):
            lengths[-1] = len(turn.prompt_ids) + len(turn.completion_ids)
        else:
            lengths.append(len(turn.prompt_ids) + len(turn.completion_ids))
        context = turn.prompt_ids + turn.completion_ids
    return lengths
