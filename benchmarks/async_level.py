"""Async speed-up: the reverse_text run at max_async_level 0 (synchronous), 1 and 2.

    uv run python benchmarks/async_level.py [--steps 12] [--levels 0 1 2] [--placements default pinned free]
                                            [--workload A|B|heavy]

Runs `rl @ configs/reverse_text/rl.toml` once per level and placement, one after the other on this
machine, each into its own temporary output dir, and reads the trainer's and the orchestrator's
metrics. Placements: `default` is what `rl` does; `pinned` / `free` force the orchestrator and vLLM's
API server onto the inference cores / leave them unpinned (`deployment.pin_orchestrator`). Start-up
and the first step (vLLM warm-up, first batch) are left out: the rate is over steps 1..N-1 of the
trainer. Workloads: A is the config as it is; B the same env with short prompts (no system prompt,
5-12 letters, at most 24 tokens); `heavy` makes generation the larger part of a step: a fresh 4-layer
model (hidden 256, untrained: only speed is measured) and completions of exactly 128 tokens
(`min_tokens`), 64 rollouts per step. Prints steps per minute, trained tokens per second, the trainer's idle fraction (waiting for
data) and inference's (the orchestrator holding generation back for the trainer), the rollouts
discarded as stale over the whole run, the mean off-policy lag of trained rollouts, and the speed-up
over the first row.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from prime_rl.runtime.monitor import read_metrics

REPO = Path(__file__).resolve().parents[1]
RL = str(Path(sys.executable).parent / "rl")


PLACEMENTS = {"default": [], "pinned": ["--deployment.pin_orchestrator", "true"],
              "free": ["--deployment.pin_orchestrator", "false"]}  # fmt: skip


def workload_args(workload: str, tmp: Path) -> list[str]:
    """A config file composed after the main one (later files win) for workloads B and heavy."""
    if workload == "A":
        return []
    if workload == "B":
        text = """[[orchestrator.envs]]
id = "reverse-text"
group_size = 8
args = { system_prompt = "", min_len = 5, max_len = 12 }
sampling = { temperature = 1.0, max_tokens = 24 }
"""
    else:
        from prime_rl.model.tiny import TinyModelConfig, make_tiny_model

        model = make_tiny_model(TinyModelConfig(output=tmp / "heavy-model", hidden_size=256,
                                                intermediate_size=768, num_layers=4))  # fmt: skip
        text = f"""model = "{model}"
[orchestrator]
batch_size = 64
[[orchestrator.envs]]
id = "reverse-text"
group_size = 8
sampling = {{ temperature = 1.0, max_tokens = 128, extra_body = {{ min_tokens = 128 }} }}
[orchestrator.eval]
envs = []
"""
    toml = tmp / f"{workload}.toml"
    toml.write_text(text)
    return ["@", str(toml)]


def run(level: int, placement: str, steps: int, out: Path, extra: list[str]) -> dict[str, float]:
    cmd = [RL, "@", str(REPO / "configs/reverse_text/rl.toml"), *extra, "--max_async_level", str(level),
           "--max_steps", str(steps), "--output_dir", str(out), "--orchestrator.eval.at_start", "false",
           "--orchestrator.eval.interval", str(steps + 1), *PLACEMENTS[placement]]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"level {level} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    trainer = read_metrics(out / "trainer" / "metrics.jsonl")[1:]
    all_orch = [m for m in read_metrics(out / "orchestrator" / "metrics.jsonl") if "time/step" in m]
    orch = all_orch[1:]
    wall = sum(m["time/step"] for m in trainer)
    return {
        "steps_per_min": 60 * len(trainer) / wall,
        "tokens_per_s": sum(m["loss_tokens"] for m in trainer) / wall,
        "trainer_idle": sum(m["time/wait_for_data"] for m in trainer) / wall,
        "inference_idle": sum(m["time/wait_trainer"] for m in orch) / sum(m["time/step"] for m in orch),
        "stale": sum(m["rollouts/all/stale"] for m in all_orch),
        "lag": sum(m["off_policy_lag/all/mean"] for m in orch) / len(orch),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--levels", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--placements", nargs="+", choices=sorted(PLACEMENTS), default=["default"])
    ap.add_argument("--workload", choices=["A", "B", "heavy"], default="A")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        extra = workload_args(args.workload, Path(tmp))
        for placement in args.placements:
            for level in args.levels:
                results[level, placement] = run(
                    level, placement, args.steps, Path(tmp) / f"{placement}_{level}", extra
                )
                print(f"level {level}, {placement} placement done", flush=True)
    base = next(iter(results.values()))
    print(
        f"{'level':>6}{'placement':>10}{'steps/min':>11}{'tokens/s':>10}{'trainer idle':>14}"
        f"{'inference idle':>16}{'stale':>7}{'lag':>6}{'speed-up':>10}"
    )
    for (level, placement), r in results.items():
        print(f"{level:>6}{placement:>10}{r['steps_per_min']:>11.1f}{r['tokens_per_s']:>10.0f}"
              f"{r['trainer_idle']:>14.2f}{r['inference_idle']:>16.2f}{r['stale']:>7}{r['lag']:>6.2f}"
              f"{r['steps_per_min'] / base['steps_per_min']:>10.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
