"""Adaptive staleness against a fixed async level, on one workload, in one run.

    uv run python benchmarks/staleness.py [--level 4 --target-ess 0.997 --steps 40]

Two `rl` runs of sum-digits (`configs/sum_digits/rl.toml` with the `grpo` overlay), one after the
other: the async level fixed at `--level`, and `[orchestrator.adaptive_async]` on with the same
level as its ceiling and `--target-ess` as its target. Printed per run: the trainer's importance-
ratio ESS (mean, min, steps below the target), the mean off-policy lag, the greedy eval and sampled
reward, and the orchestrator's time; then the ratios adaptive / fixed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.open()]


def run(name: str, args, extra: list[str]) -> dict:
    out = Path(args.output) / name
    shutil.rmtree(out, ignore_errors=True)
    cmd = [str(Path(sys.executable).parent / "rl"), "@", "configs/sum_digits/rl.toml", "@", "configs/algorithms/grpo.toml",
           "--max-steps", str(args.steps), "--max-async-level", str(args.level), "--output-dir", str(out), *extra]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True)
    trainer, orch = read(out / "trainer" / "metrics.jsonl"), read(out / "orchestrator" / "metrics.jsonl")
    ess = [r["is_ratio/all/ess"] for r in trainer]
    steps = [r for r in orch if "reward/all/mean" in r]
    evals = [v for r in orch for k, v in r.items() if k.startswith("eval/") and k.endswith("/reward/mean")]
    rewards = [r["reward/all/mean"] for r in steps]
    return {
        "ess_mean": sum(ess) / len(ess),
        "ess_min": min(ess),
        "steps_below_target": sum(e < args.target_ess for e in ess),
        "steps": len(ess),
        "lag": sum(r["off_policy_lag/all/mean"] for r in steps) / len(steps),
        "greedy": evals,
        "sampled_last5": sum(rewards[-5:]) / 5,
        "orchestrator_s": sum(r["time/step"] for r in steps),
        "levels": [r.get("async/level") for r in steps],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--level", type=int, default=4)
    ap.add_argument("--target-ess", type=float, default=0.997)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--output", default="outputs/staleness")
    args = ap.parse_args()
    fixed = run(f"fixed{args.level}", args, [])
    adaptive = run(f"adaptive{args.level}", args, ["--orchestrator.adaptive-async.enabled", "true",
                                                  "--orchestrator.adaptive-async.target-ess", str(args.target_ess)])  # fmt: skip
    for name, f in (("fixed", fixed), ("adaptive", adaptive)):
        print(f"{name}: ESS mean {f['ess_mean']:.4f} min {f['ess_min']:.4f}, below {args.target_ess} on "
              f"{f['steps_below_target']}/{f['steps']} steps; lag {f['lag']:.2f}; greedy "
              f"{' / '.join(f'{v:.2f}' for v in f['greedy'])}; sampled (last 5) {f['sampled_last5']:.3f}; "
              f"orchestrator {f['orchestrator_s']:.0f} s")  # fmt: skip
    print(f"adaptive levels: {adaptive['levels']}")
    print(f"adaptive / fixed: steps below target {adaptive['steps_below_target']}/{fixed['steps_below_target']}, "
          f"final greedy {adaptive['greedy'][-1] / fixed['greedy'][-1]:.2f}x, "
          f"orchestrator time {adaptive['orchestrator_s'] / fixed['orchestrator_s']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
