"""Opt-in per-token export of what the loss saw, one JSONL line per packed sample.

Layout: `<output_dir>/trainer/tokens/step_<N>/rank_<r>.jsonl` (r: the data-parallel rank; with
context parallelism the group's cp rank 0 writes its whole micro-batches), and `READY` in the step
folder once every rank's file is complete. Non-finite numbers are written as null.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from prime_rl.runtime.disk import writing
from prime_rl.trainer.parallel.dist import World
from prime_rl.trainer.rl.trainer import MicroBatchResult


def _clean(values: list[float]) -> list[float | None]:
    return [v if math.isfinite(v) else None for v in values]


def export_tokens(output_dir: Path, step: int, results: list[MicroBatchResult], world: World) -> Path:
    folder = Path(output_dir) / "trainer" / "tokens" / f"step_{step}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank_{world.dp_rank}.jsonl"
    if world.cp_rank == 0:
        with writing(path, f"the token export of step {step}"):
            _write(path, step, results, world.dp_rank)
    if world.distributed:
        dist.barrier()
    if world.is_main:
        (folder / "READY").touch()
    return path


def _write(path: Path, step: int, results: list[MicroBatchResult], rank: int) -> None:
    with path.open("w") as f:
        for r in results:
            mb = r.batch.source
            a = mb.arrays()
            trainer_lp = r.trainer_logprobs.float().cpu()
            ratio = torch.exp(trainer_lp - torch.from_numpy(a["logprobs"].copy()))
            start = 0
            advantages = r.advantages.float().cpu()
            for i, (n, env) in enumerate(zip(mb.sample_lens, mb.env_names, strict=True)):
                sl = slice(start, start + n)
                record = {
                    "step": step,
                    "rank": rank,
                    "micro_batch": mb.index,
                    "env": env,
                    "input_ids": a["input_ids"][sl].tolist(),
                    "loss_mask": a["loss_mask"][sl].tolist(),
                    "policy": list(mb.policy_spans[i]) if mb.policy_spans else None,
                    "rollout_advantage": _clean([mb.advantages[i]])[0],
                    "reward": _clean([mb.rewards[i]])[0],
                    "advantages": _clean(advantages[sl].tolist()),
                    "sampling_logprobs": _clean(a["logprobs"][sl].tolist()),
                    "trainer_logprobs": _clean(trainer_lp[sl].tolist()),
                    "ratio": _clean(ratio[sl].tolist()),
                    "token_loss": _clean(r.token_loss[sl].float().cpu().tolist()),
                    **{k: v[sl].int().cpu().tolist() for k, v in r.masks.items()},
                }
                f.write(json.dumps(record) + "\n")
                start += n
