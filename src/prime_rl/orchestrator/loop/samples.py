"""Turn rollouts into training samples.

Invariant: a sample's tokens are exactly the tokens the server saw and sampled (never re-tokenized
text). Multi-turn: when a turn's prompt extends the previous prompt plus completion, the turns merge
into one sample and the tokens in between (env or tool messages) get loss mask 0 and logprob 0;
a turn that does not extend the previous one starts a new sample. `segments` is the one place
that rule lives: samples and their lengths both follow it.

Routes (MoE): each token's routed experts come from the first call that forwarded it: a sampled
token from the call that sampled it (the routing that produced its logprob), an env token from the
next call's prompt. The last token, which no call forwarded, repeats the routes before it (its
output reaches no trained prediction). A sample with any other token unrouted is a `RoutesMissing`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prime_rl.orchestrator.rollout import Rollout, Turn
from prime_rl.transport.messages import ROUTE_DTYPES, TrainingSample, route_dtype


class RoutesMissing(ValueError):
    """Routes are required, and a rollout's tokens came without them."""


def _extends(prefix: list[int], ids: list[int]) -> bool:
    return len(ids) >= len(prefix) and ids[: len(prefix)] == prefix


def segments(rollout: Rollout) -> list[list[Turn]]:
    """The rollout's turns, split where a turn's prompt does not extend the previous context."""
    out: list[list[Turn]] = []
    context: list[int] = []  # prompt + completion so far of the current segment
    for turn in rollout.turns:
        if out and _extends(context, turn.prompt_ids):
            out[-1].append(turn)
        else:
            out.append([turn])
        context = turn.prompt_ids + turn.completion_ids
    return out


@dataclass(frozen=True)
class TurnStats:
    """The shape of a (multi-turn) rollout, for per-env metrics."""

    turns: int
    """Model calls."""
    samples: int
    """Training samples it becomes: 1, unless a turn's prompt did not extend the previous context."""
    model_tokens: int
    """Sampled tokens, over all turns."""
    env_tokens: int
    """Tokens the env (or tools) added between turns: what each prompt has beyond the previous
    prompt and completion."""


def turn_stats(rollout: Rollout) -> TurnStats:
    env_tokens, previous = 0, None
    for turn in rollout.turns:
        if previous is not None:
            env_tokens += max(
                0, len(turn.prompt_ids) - len(previous.prompt_ids) - len(previous.completion_ids)
            )
        previous = turn
    return TurnStats(len(rollout.turns), len(segments(rollout)), rollout.num_completion_tokens, env_tokens)


def sample_lengths(rollout: Rollout) -> list[int]:
    """Token counts of the samples `rollout_to_samples` builds (a merged sample ends with its last turn)."""
    return [len(seg[-1].prompt_ids) + len(seg[-1].completion_ids) for seg in segments(rollout)]


def distill_advantages(turn: Turn, weight: float) -> list[float]:
    """Per completion token, `weight` x (teacher logprob - sampling logprob): minus the per-token
    estimate of the reverse KL from the student to the teacher, on sampled tokens (0 elsewhere)."""
    teacher = turn.teacher_logprobs or []
    if len(teacher) != len(turn.completion_ids):
        raise ValueError(f"{len(teacher)} teacher logprobs for {len(turn.completion_ids)} completion tokens")
    return [
        weight * (t - s) if m else 0.0
        for t, s, m in zip(teacher, turn.completion_logprobs, turn.completion_mask, strict=True)
    ]


def segment_routes(seg: list[Turn], length: int, num_experts: int) -> tuple[np.ndarray | None, str | None]:
    """The routes [length, layers, top-k] of a segment's sample, of the route dtype for
    `num_experts`, or (None, why) when the calls did not route every token (module docstring)."""
    routed = [t for t in seg if t.routes is not None and len(t.routes)]
    if not routed:
        return None, "the server returned no routed experts"
    shape = routed[0].routes.shape[1:]
    if any(t.routes.shape[1:] != shape for t in routed):
        return None, f"the calls' routes disagree in shape: {sorted({t.routes.shape[1:] for t in routed})}"
    dtype = ROUTE_DTYPES[route_dtype(num_experts)]
    out = np.zeros((length, *shape), dtype=dtype)
    have = np.zeros(length, dtype=bool)
    for t in routed:
        start = t.routes_start
        end = min(start + len(t.routes), length)
        fresh = ~have[start:end]
        out[start:end][fresh] = t.routes[: end - start][fresh]
        have[start:end] = True
    if length > 1 and not have[-1] and have[-2]:
        out[-1], have[-1] = out[-2], True
    if not have.all():
        missing = np.flatnonzero(~have)
        return None, f"{len(missing)} of {length} tokens have no routes (first at position {missing[0]})"
    return out, None


def rollout_to_samples(
    rollout: Rollout,
    advantage: float,
    temperature: float = 1.0,
    reward: float | None = None,
    distill_weight: float = 0.0,
    num_experts: int = 0,
) -> list[TrainingSample]:
    """The rollout's training samples; `reward` (default: the rollout's) travels with each. With a
    `distill_weight`, each model token's advantage gains its `distill_advantages` term. With
    `num_experts` (a MoE whose routes are required), each carries its routes (`segment_routes`),
    and a rollout without them is a `RoutesMissing`."""
    samples = []
    for seg in segments(rollout):
        first = seg[0]
        ids, mask, logprobs = (
            list(first.completion_ids),
            list(first.completion_mask),
            list(first.completion_logprobs),
        )
        token_advantages = distill_advantages(first, distill_weight) if distill_weight else []
        context = len(first.prompt_ids) + len(first.completion_ids)
        for turn in seg[1:]:
            inserted = turn.prompt_ids[context:]
            ids += inserted + turn.completion_ids
            mask += [0] * len(inserted) + turn.completion_mask
            logprobs += [0.0] * len(inserted) + turn.completion_logprobs
            if distill_weight:
                token_advantages += [0.0] * len(inserted) + distill_advantages(turn, distill_weight)
            context = len(turn.prompt_ids) + len(turn.completion_ids)
        route_fields = {}
        if num_experts:
            length = len(first.prompt_ids) + len(ids)
            routes, why = segment_routes(seg, length, num_experts)
            if routes is None:
                raise RoutesMissing(
                    f"orchestrator.return_routes = true, but a rollout of env '{rollout.env_name}', example "
                    f"{rollout.example_id!r} came without them: {why}. Start vLLM with "
                    "--enable-return-routed-experts (`rl` does), or set return_routes = false"
                )
            route_fields = {
                "routes": routes.tobytes(),
                "route_shape": list(routes.shape[1:]),
                "route_dtype": route_dtype(num_experts),
            }
        samples.append(
            TrainingSample(
                **route_fields,
                prompt_ids=list(first.prompt_ids),
                completion_ids=ids,
                completion_mask=mask,
                completion_logprobs=logprobs,
                advantage=advantage,
                reward=rollout.reward if reward is None else reward,
                env_name=rollout.env_name,
                example_id=rollout.example_id,
                policy_version=rollout.policy_version,
                policy_end=rollout.policy_span[1],
                temperature=temperature,
                token_advantages=token_advantages,
            )
        )
    return samples
