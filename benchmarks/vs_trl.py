"""prime_rl against TRL's GRPOTrainer on one machine: the same model, task, geometry, optimizer and
cores, one after the other, in one run.

    uv sync --group trl
    uv run python benchmarks/vs_trl.py [--steps 20] [--geometry short long] [--seeds 1]
        [--rows sync-server async-server sync-engine async-engine async-engine-decoupled]

The task is reverse-text without a system prompt (strings of 5-12 letters, reward: the LCS ratio to
the reversed string), from `models/reverse_text-tiny`, 16 prompts x 8 completions a step at
temperature 1, AdamW at lr 1e-3 with 5 warmup steps, std-normalized group advantages, no KL, and
no checkpoints on either side.
Geometries: `short`, completions of at most 24 tokens; `long`, completions of exactly 100 tokens
(`min_tokens`): generation is then most of a step.

Each framework runs in its own process on every core this one may use: TRL generates with HF
`generate` and then trains, in turns; prime_rl runs `rl` (vLLM, orchestrator, trainer), synchronous
(`max_async_level = 0`) and asynchronous (1), each with vLLM as a server and as the orchestrator's
in-process engine (`deployment.inference_mode`), and on request (`--rows async-engine-decoupled`)
asynchronous with decoupled PPO and TIS. Steps are timed from the end of the first one to the end
of the last (start-up and the warm-up step are left out). Prints seconds per step, rollouts and
generated tokens per second, the mean reward of the first and last three steps, and each row's
steps/s as a ratio to TRL's. With `--seeds N` each row runs N times, the frameworks taking turns
(seeds 0..N-1: TRL's trainer seed, and our orchestrator's example order and vLLM's sampling seed):
one run's reward is one draw, so comparing how much two frameworks learn takes several.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "reverse_text-tiny"
PROMPTS, GROUP = 16, 8
LR, WARMUP = 1e-3, 5
GEOMETRIES = {"short": {"max_tokens": 24, "min_tokens": 0}, "long": {"max_tokens": 100, "min_tokens": 100}}


def summary(step_s: list[float], tokens: list[float], rewards: list[float]) -> dict:
    """Per-step figures, from the second step on."""
    wall = sum(step_s[1:])
    n = len(step_s) - 1
    return {
        "s_per_step": wall / n,
        "rollouts_per_s": n * PROMPTS * GROUP / wall,
        "tokens_per_s": sum(tokens[1:]) / wall,
        "reward_start": sum(rewards[:3]) / 3,
        "reward_end": sum(rewards[-3:]) / 3,
    }


# --- TRL, in a process of its own -----------------------------------------------------------------


def trl_worker(geometry: str, steps: int, out: Path, seed: int = 0) -> None:
    import warnings

    warnings.filterwarnings("ignore")  # trl warns about the installed vLLM, which it does not use here
    import torch
    from datasets import Dataset
    from reverse_text import lcs_ratio, make_examples
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    g = GEOMETRIES[geometry]
    rows = make_examples(PROMPTS * steps, 0, 5, 12)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
                              for r in rows])  # fmt: skip

    def reward(completions, answer, **_) -> list[float]:
        return [lcs_ratio(c[-1]["content"].strip(), a) for c, a in zip(completions, answer, strict=True)]

    config = GRPOConfig(
        output_dir=str(out.parent / "trl"), use_cpu=True, report_to="none", save_strategy="no",
        bf16=False, gradient_checkpointing=False,  # TRL's defaults; ours trains float32 in full
        per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP,
        max_completion_length=g["max_tokens"], temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs={"min_new_tokens": g["min_tokens"]} if g["min_tokens"] else None,
        learning_rate=LR, warmup_steps=WARMUP, lr_scheduler_type="constant_with_warmup",
        weight_decay=0.0, max_grad_norm=1.0, max_steps=steps, seed=seed, logging_steps=1,
        beta=0.0, num_iterations=1, scale_rewards="group",
    )  # fmt: skip
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    trainer = GRPOTrainer(model=str(MODEL), reward_funcs=reward, args=config, train_dataset=data)
    trainer.add_callback(Clock())
    trainer.train()
    logs = [m for m in trainer.state.log_history if "reward" in m]
    step_s = [b - a for a, b in itertools.pairwise(ends)]
    tokens = [m["completions/mean_length"] * PROMPTS * GROUP for m in logs]
    out.write_text(json.dumps(summary(step_s, tokens, [m["reward"] for m in logs])))


def run_trl(geometry: str, steps: int, tmp: Path, seed: int = 0) -> dict:
    out = tmp / f"trl-{geometry}-{seed}.json"
    cmd = [sys.executable, __file__, "--trl-worker", geometry, "--steps", str(steps), "--out", str(out),
           "--seed", str(seed)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"TRL failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


# --- prime_rl: `rl` as a user runs it ------------------------------------------------------------


def run_ours(
    geometry: str,
    level: int,
    steps: int,
    tmp: Path,
    mode: str = "server",
    seed: int = 0,
    extra_args: tuple[str, ...] = (),
) -> dict:
    from prime_rl.runtime.monitor import read_metrics

    g = GEOMETRIES[geometry]
    extra = f", extra_body = {{ min_tokens = {g['min_tokens']} }}" if g["min_tokens"] else ""
    toml = tmp / f"{geometry}.toml"
    # TRL saves nothing (save_strategy "no"): neither does this run (the base config checkpoints
    # every 5 steps, which a resumable run wants and a speed comparison must leave out on both sides).
    toml.write_text(f"""[trainer.scheduler]
warmup_steps = {WARMUP}
[trainer.ckpt]
interval = {steps + 1}
[trainer.optim]
lr = {LR}
[orchestrator]
batch_size = {PROMPTS * GROUP}
[[orchestrator.envs]]
id = "reverse-text"
group_size = {GROUP}
args = {{ system_prompt = "", min_len = 5, max_len = 12 }}
sampling = {{ temperature = 1.0, max_tokens = {g["max_tokens"]}{extra} }}
[orchestrator.eval]
envs = []
""")
    # A fresh folder every time: a run in an existing one would resume it.
    out = Path(tempfile.mkdtemp(prefix=f"ours-{geometry}-{level}-{mode}-{seed}-", dir=tmp))
    rl = str(Path(sys.executable).parent / "rl")
    cmd = [rl, "@", str(REPO / "configs/reverse_text/rl.toml"), "@", str(toml), "--max_async_level", str(level),
           "--max_steps", str(steps), "--output_dir", str(out), "--deployment.inference_mode", mode,
           "--orchestrator.seed", str(seed), "--inference.seed", str(seed), *extra_args]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"rl failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    trainer = read_metrics(out / "trainer" / "metrics.jsonl")
    orch = [m for m in read_metrics(out / "orchestrator" / "metrics.jsonl") if "time/step" in m]
    tokens = [m["completion_len/all/mean"] * PROMPTS * GROUP for m in orch]
    return summary([m["time/step"] for m in trainer], tokens, [m["reward/all/mean"] for m in orch])


DECOUPLED = ("--trainer.loss.old_policy", "trainer", "--trainer.rollout_correction.type", "tis")
"""Decoupled PPO with TIS: the clip against the trainer's own policy at the step's start, the
staleness weighed by min(pi_old / mu, 2) instead (docs/algorithms.md)."""

OURS = {
    "sync-server": (0, "server", "prime_rl sync", ()),
    "async-server": (1, "server", "prime_rl async", ()),
    "sync-engine": (0, "engine", "prime_rl sync engine", ()),
    "async-engine": (1, "engine", "prime_rl async engine", ()),
    "async-engine-decoupled": (1, "engine", "prime_rl async decoupled", DECOUPLED),
}
"""Our rows by `--rows` name: (max_async_level, deployment.inference_mode, name, extra `rl` args)."""

DEFAULT_ROWS = ("sync-server", "async-server", "sync-engine", "async-engine")


def combined(runs: list[dict]) -> dict:
    """One row from a framework's runs (one per seed): medians of the speeds, means of the rewards,
    and the spread of the reward's rise (last three steps minus first three) over the runs."""
    gains = [r["reward_end"] - r["reward_start"] for r in runs]
    row = {k: statistics.median(r[k] for r in runs) for k in ("s_per_step", "rollouts_per_s", "tokens_per_s")}
    row |= {k: statistics.fmean(r[k] for r in runs) for k in ("reward_start", "reward_end")}
    return row | {"gain_min": min(gains), "gain_max": max(gains)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--geometry", nargs="+", choices=sorted(GEOMETRIES), default=["short", "long"])
    ap.add_argument("--rows", nargs="+", choices=list(OURS), default=list(DEFAULT_ROWS),
                    help="which of our runs to make (TRL always runs)")  # fmt: skip
    ap.add_argument("--seeds", type=int, default=1,
                    help="runs per row, seeds 0..N-1 (TRL's trainer seed, our orchestrator's): rewards are "
                         "then means with the spread of their rise, speeds medians")  # fmt: skip
    ap.add_argument("--trl-worker", choices=sorted(GEOMETRIES), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        return trl_worker(args.trl_worker, args.steps, args.out, args.seed)
    print(
        f"{len(os.sched_getaffinity(0))} cores, {args.steps} steps of {PROMPTS} x {GROUP} rollouts, "
        f"{args.seeds} run(s) per row",
        flush=True,
    )
    ours = [OURS[k] for k in OURS if k in args.rows]
    header = (
        f"{'geometry':>9}{'run':>26}{'s/step':>8}{'rollouts/s':>12}{'gen tok/s':>11}{'reward':>16}"
        f"{'rise (min..max)':>17}{'vs TRL':>8}"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for geometry in args.geometry:
            runs: dict[str, list[dict]] = {}
            for seed in range(args.seeds):
                # The frameworks take turns per seed: a slow spell of the machine hits both.
                one = {"TRL GRPOTrainer": run_trl(geometry, args.steps, Path(tmp), seed)}
                for level, mode, name, extra in ours:
                    one[name] = run_ours(geometry, level, args.steps, Path(tmp), mode, seed, extra)
                for name, r in one.items():
                    runs.setdefault(name, []).append(r)
                    print(f"  {geometry} seed {seed} {name}: {r['s_per_step']:.3f} s/step, reward "
                          f"{r['reward_start']:.3f} -> {r['reward_end']:.3f}", flush=True)  # fmt: skip
            trl = combined(runs["TRL GRPOTrainer"])["s_per_step"]
            for name, results in runs.items():
                r = combined(results)
                rows.append(
                    f"{geometry:>9}{name:>26}{r['s_per_step']:>8.3f}{r['rollouts_per_s']:>12.0f}"
                    f"{r['tokens_per_s']:>11.0f}{r['reward_start']:>8.3f}->{r['reward_end']:.3f}"
                    f"{r['gain_min']:>+9.3f}..{r['gain_max']:+.3f}{trl / r['s_per_step']:>7.2f}x"
                )
    print(header, *rows, sep="\n")


if __name__ == "__main__":
    main()
