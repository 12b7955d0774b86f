"""Pack training samples into micro-batches and spread them over the trainer's ranks.

Invariants:
- a micro-batch holds at most `seq_len` tokens, and only samples of one sampling temperature;
- samples are whole (never split), position ids restart at 0 for each sample;
- every rank gets the same number of micro-batches (filler micro-batches have loss mask 0), and the
  ranks' token counts are balanced greedily (largest bin to the lightest rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain, repeat

import numpy as np

from prime_rl.transport.contract import OrchestratorSide
from prime_rl.transport.messages import FLOAT_DTYPE, ID_DTYPE, MASK_DTYPE, Header, MicroBatch, TrainingSample

FILLER_TOKENS = 1
"""Length of a filler micro-batch: one pad token, fully masked."""

FILLER_ENV = ""
"""The env name of a filler micro-batch's one sample (no env has it)."""


@dataclass
class Bin:
    samples: list[TrainingSample] = field(default_factory=list)
    tokens: int = 0


def pack_bins(samples: list[TrainingSample], seq_len: int) -> list[Bin]:
    """First-fit decreasing, per temperature. A sample longer than seq_len is a ValueError."""
    bins: list[Bin] = []
    by_temperature: dict[float, list[TrainingSample]] = {}
    for s in samples:
        if len(s) > seq_len:
            raise ValueError(
                f"a training sample of env '{s.env_name}' has {len(s)} tokens, more than seq_len = {seq_len}"
            )
        by_temperature.setdefault(s.temperature, []).append(s)
    for group in by_temperature.values():
        open_bins: list[Bin] = []
        for s in sorted(group, key=len, reverse=True):
            n = len(s)
            target = next((b for b in open_bins if b.tokens + n <= seq_len), None)
            if target is None:
                target = Bin()
                open_bins.append(target)
            target.samples.append(s)
            target.tokens += n
        bins.extend(open_bins)
    return bins


def assign_ranks(bins: list[Bin], num_ranks: int) -> list[list[Bin]]:
    """Same number of bins per rank (short ranks are padded later), token counts balanced."""
    per_rank = max(1, -(-len(bins) // num_ranks))
    ranks: list[list[Bin]] = [[] for _ in range(num_ranks)]
    loads = [0] * num_ranks
    for b in sorted(bins, key=lambda b: b.tokens, reverse=True):
        open_ranks = [r for r in range(num_ranks) if len(ranks[r]) < per_rank]
        r = min(open_ranks, key=lambda r: loads[r])
        ranks[r].append(b)
        loads[r] += b.tokens
    return ranks


def bin_arrays(b: Bin) -> dict[str, np.ndarray]:
    # Built with fromiter/repeat rather than Python list concatenation: packing runs on every token
    # of every step, on the orchestrator's one core.
    samples, n = b.samples, b.tokens
    lens = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    out = {
        "input_ids": np.fromiter(
            chain.from_iterable(chain(s.prompt_ids, s.completion_ids) for s in samples),
            dtype=ID_DTYPE,
            count=n,
        ),
        "position_ids": np.arange(n, dtype=ID_DTYPE) - starts.astype(ID_DTYPE),
        "loss_mask": np.fromiter(
            chain.from_iterable(chain(repeat(0, len(s.prompt_ids)), s.completion_mask) for s in samples),
            dtype=MASK_DTYPE,
            count=n,
        ),
        "logprobs": np.fromiter(
            chain.from_iterable(
                chain(repeat(0.0, len(s.prompt_ids)), s.completion_logprobs) for s in samples
            ),
            dtype=FLOAT_DTYPE,
            count=n,
        ),
    }
    if any(s.token_advantages for s in samples):
        out["token_advantages"] = np.fromiter(
            chain.from_iterable(
                chain(
                    repeat(0.0, len(s.prompt_ids)), s.token_advantages or repeat(0.0, len(s.completion_ids))
                )
                for s in samples
            ),
            dtype=FLOAT_DTYPE,
            count=n,
        )
    routed = [s for s in samples if s.routes]
    if routed:
        kinds = {(tuple(s.route_shape), s.route_dtype) for s in samples}
        if len(routed) != len(samples) or len(kinds) > 1:
            # Replay is per micro-batch: a sample without the others' routes would be routed by
            # the trainer while its neighbours replay, which no configuration asks for.
            envs = sorted({s.env_name for s in samples})
            raise ValueError(
                f"samples of envs {envs} packed together disagree about routes: {len(routed)} of {len(samples)} "
                f"carry them, with shapes/dtypes {sorted(kinds)}; every sample must carry routes of one shape or none"
            )
        out["routes"] = np.concatenate([s.route_array() for s in samples])
    return out


def filler_arrays(pad_id: int) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.full(FILLER_TOKENS, pad_id),
        "position_ids": np.arange(FILLER_TOKENS),
        "loss_mask": np.zeros(FILLER_TOKENS),
        "logprobs": np.zeros(FILLER_TOKENS, dtype=np.float32),
    }


def pack(
    samples: list[TrainingSample],
    seq_len: int,
    num_ranks: int,
    run_id: str,
    step: int,
    pad_id: int = 0,
    orchestrator: OrchestratorSide | None = None,
) -> list[list[MicroBatch]]:
    """The micro-batches of one step, as one list per trainer rank, each carrying `orchestrator`
    (the sender's side of the run contract)."""
    ranks = assign_ranks(pack_bins(samples, seq_len), num_ranks)
    count = max(1, max(len(r) for r in ranks))  # a step with nothing to train still reaches every rank
    out: list[list[MicroBatch]] = []
    for rank, rank_bins in enumerate(ranks):
        header = Header(run_id, step, rank)
        mbs = []
        for index in range(count):
            filler = index >= len(rank_bins)
            if not filler:
                b = rank_bins[index]
                arrays = bin_arrays(b)
                lens, envs = [len(s) for s in b.samples], [s.env_name for s in b.samples]
                advantages, rewards = [s.advantage for s in b.samples], [s.reward for s in b.samples]
                temperature = b.samples[0].temperature
                spans = [(s.policy_version, max(s.policy_version, s.policy_end or 0)) for s in b.samples]
            else:
                arrays, lens, envs, temperature = filler_arrays(pad_id), [FILLER_TOKENS], [FILLER_ENV], 1.0
                advantages = rewards = [0.0]
                spans = []
            mbs.append(
                MicroBatch.from_arrays(
                    header,
                    index,
                    count,
                    **arrays,
                    sample_lens=lens,
                    env_names=envs,
                    advantages=advantages,
                    rewards=rewards,
                    temperature=temperature,
                    orchestrator=orchestrator,
                    filler=filler,
                    policy_spans=spans,
                )
            )
        out.append(mbs)
    return out
