"""Preference pairs for reward-model training: read, tokenized, split, streamed and packed.

Invariants:
- held-out pairs never train: the split is fixed by the seed alone, whatever the ranks or the step
  a run resumes from;
- the pairs of step k are the same in a run resumed at any step and in an uninterrupted one
  (`pair_stream` skips what earlier steps consumed);
- a packed micro-batch holds whole pairs as consecutive samples [chosen_0, rejected_0, chosen_1, ...]
  whose one loss token is their last (where the score is read), position ids restart per sample,
  and every data-parallel rank gets the same number of micro-batches (filler ones have no sample).
"""

from __future__ import annotations

import importlib
import json
import random
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from prime_rl.environments import env_module_name
from prime_rl.model.reward import encode, plain_messages
from prime_rl.trainer.reward_model.config import PairsConfig
from prime_rl.transport.messages import Header, MicroBatch
from prime_rl.transport.packing import FILLER_ENV, FILLER_TOKENS, filler_arrays

ENV_NAME = "reward_model"
"""The env name of a packed pair's samples (the step's per-env statistics group by it)."""


class PairsError(ValueError):
    """The preference pairs cannot be read; the message names the file and line, or the env."""


class Pair(NamedTuple):
    """A pair's token ids, as the reward model scores them (`prime_rl.model.reward.encode`)."""

    chosen: list[int]
    rejected: list[int]

    @property
    def tokens(self) -> int:
        return len(self.chosen) + len(self.rejected)


def _messages(value: Any, role: str, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
        return plain_messages(value)
    raise PairsError(f"{where}: expected a string or a list of {{'role', 'content'}} messages")


def read_pairs(config: PairsConfig, seed: int) -> list[tuple[list[dict], list[dict], list[dict]]]:
    """Every pair as (prompt, chosen, rejected) message lists."""
    if config.path is not None:
        if not config.path.is_file():
            raise PairsError(f"data.path '{config.path}' not found")
        rows = []
        for i, line in enumerate(config.path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append((json.loads(line), f"{config.path}:{i}"))
                except json.JSONDecodeError as e:
                    raise PairsError(f"{config.path}:{i}: not JSON ({e})") from None
    else:
        name = env_module_name(config.env_id)
        try:
            module = importlib.import_module(name)
        except Exception as e:
            raise PairsError(f"data.env_id '{config.env_id}': module '{name}' does not import: {e}") from None
        make = getattr(module, "preference_pairs", None)
        if not callable(make):
            raise PairsError(
                f"data.env_id '{config.env_id}': module '{name}' has no preference_pairs(num_pairs, seed); "
                "give data.path instead"
            )
        rows = [(r, f"env '{config.env_id}' pair {i}") for i, r in enumerate(make(config.num_pairs, seed))]
    pairs = []
    for row, where in rows:
        if not isinstance(row, dict) or not {"prompt", "chosen", "rejected"} <= row.keys():
            raise PairsError(f"{where}: expected keys 'prompt', 'chosen' and 'rejected'")
        pairs.append(
            (
                _messages(row["prompt"], "user", f"{where} 'prompt'"),
                _messages(row["chosen"], "assistant", f"{where} 'chosen'"),
                _messages(row["rejected"], "assistant", f"{where} 'rejected'"),
            )
        )
    if len(pairs) < 2:
        raise PairsError("need at least 2 preference pairs (one to train, one to hold out)")
    return pairs


def split_pairs(config: PairsConfig, tokenizer, max_length: int, seed: int) -> tuple[list[Pair], list[Pair]]:
    """(training pairs, held-out pairs), tokenized; the split depends on the data and the seed only."""
    encoded = [
        Pair(encode(tokenizer, p, c, max_length), encode(tokenizer, p, r, max_length))
        for p, c, r in read_pairs(config, seed)
    ]
    if any(not pair.chosen or not pair.rejected for pair in encoded):
        raise PairsError("a conversation of the pairs renders to no token: nothing to score it at")
    random.Random(seed).shuffle(encoded)
    n_eval = max(1, int(len(encoded) * config.eval_fraction))
    return encoded[n_eval:], encoded[:n_eval]


def pair_stream(pairs: list[Pair], seed: int, start: int) -> Iterator[Pair]:
    """Endless epochs, each reshuffled by (seed, epoch); `start` skips the pairs earlier steps
    consumed (for resume)."""
    epoch, skip = divmod(start, len(pairs))
    while True:
        order = list(range(len(pairs)))
        random.Random(f"{seed}-pairs-{epoch}").shuffle(order)
        for j in order[skip:]:
            yield pairs[j]
        epoch, skip = epoch + 1, 0


def _bins(pairs: list[Pair], seq_len: int) -> list[list[Pair]]:
    """First-fit decreasing: whole pairs into bins of at most `seq_len` tokens."""
    bins: list[list[Pair]] = []
    loads: list[int] = []
    for pair in sorted(pairs, key=lambda p: p.tokens, reverse=True):
        if pair.tokens > seq_len:
            raise PairsError(f"a pair of {pair.tokens} tokens does not fit seq_len = {seq_len}")
        k = next((k for k, load in enumerate(loads) if load + pair.tokens <= seq_len), None)
        if k is None:
            bins.append([])
            loads.append(0)
            k = len(bins) - 1
        bins[k].append(pair)
        loads[k] += pair.tokens
    return bins


def _spread(bins: list[list[Pair]], ranks: int) -> list[list[list[Pair]]]:
    """The bins dealt to `ranks` ranks, as evenly in count as possible, then in tokens (largest bin
    to the lightest rank with room)."""
    per_rank = max(1, -(-len(bins) // ranks))
    out: list[list[list[Pair]]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for b in sorted(bins, key=lambda b: sum(p.tokens for p in b), reverse=True):
        r = min((r for r in range(ranks) if len(out[r]) < per_rank), key=lambda r: loads[r])
        out[r].append(b)
        loads[r] += sum(p.tokens for p in b)
    return out


def _micro_batch(header: Header, index: int, count: int, pairs: list[Pair]) -> MicroBatch:
    samples = [ids for pair in pairs for ids in pair]
    lens = [len(s) for s in samples]
    ends = np.cumsum(lens)
    loss_mask = np.zeros(int(ends[-1]), dtype=np.uint8)
    loss_mask[ends - 1] = 1
    return MicroBatch.from_arrays(
        header,
        index,
        count,
        input_ids=np.fromiter((t for s in samples for t in s), dtype=np.int64, count=int(ends[-1])),
        position_ids=np.concatenate([np.arange(n) for n in lens]),
        loss_mask=loss_mask,
        logprobs=np.zeros(int(ends[-1]), dtype=np.float32),
        sample_lens=lens,
        env_names=[ENV_NAME] * len(lens),
    )


def _filler(header: Header, index: int, count: int) -> MicroBatch:
    """A micro-batch with no sample (one pad token, no loss token), as `transport.packing.pack` sends."""
    arrays = filler_arrays(0)
    return MicroBatch.from_arrays(
        header, index, count, **arrays, sample_lens=[FILLER_TOKENS], env_names=[FILLER_ENV], filler=True
    )


def pack_pairs(pairs: list[Pair], seq_len: int, ranks: int, run_id: str, step: int) -> list[list[MicroBatch]]:
    """One list of micro-batches per data-parallel rank, all of the same length."""
    per_rank = _spread(_bins(pairs, seq_len), ranks)
    count = max(1, max(len(r) for r in per_rank))  # a rank without pairs still runs the step's collectives
    out = []
    for rank, bins in enumerate(per_rank):
        header = Header(run_id, step, rank)
        mbs = [_micro_batch(header, i, count, b) for i, b in enumerate(bins)]
        mbs += [_filler(header, i, count) for i in range(len(mbs), count)]
        out.append(mbs)
    return out
