"""Draw the figures of docs/algorithms.md from the runs of configs/algorithms/ (each run with
`uv run rl @ configs/sum_digits/rl.toml @ configs/algorithms/<name>.toml`, into outputs/algorithms/).

    uv run python scripts/algorithm_figures.py [--runs outputs/algorithms] [--out docs/img]

Writes gae_vs_grpo.png (sampled and greedy reward of both), kl_control.png (the KL per sample
against its target, and beta, of every kl_adaptive* run) and losses.png (grpo, dapo, cispo, gspo
and ppo_tis), and prints each run's summary line: sampled and greedy reward, and the trainer's
mismatch KL and importance-ratio ESS averaged over the steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from prime_rl.plot import plot_compare

LOSS_RUNS = ("grpo", "dapo", "cispo", "gspo", "ppo_tis")


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.open()] if path.is_file() else []


def summary(run: Path) -> str:
    orch = read(run / "orchestrator" / "metrics.jsonl")
    rewards = [
        r["reward/all/mean"]
        for r in sorted((r for r in orch if "reward/all/mean" in r), key=lambda r: r["step"])
    ]
    evals = [v for r in orch for k, v in r.items() if k.startswith("eval/") and k.endswith("/reward/mean")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    greedy = " / ".join(f"{v:.2f}" for v in evals)
    trainer = read(run / "trainer" / "metrics.jsonl")
    kl = [r["mismatch_kl/all/mean"] for r in trainer if "mismatch_kl/all/mean" in r]
    ess = [r["is_ratio/all/ess"] for r in trainer if "is_ratio/all/ess" in r]
    extra = f", mismatch KL {sum(kl) / len(kl):.2e}" if kl else ""
    extra += f", ESS {sum(ess) / len(ess):.4f} (min {min(ess):.4f})" if ess else ""
    return f"{run.name}: sampled {first:.3f} -> {last:.3f} ({last - first:+.3f}), greedy {greedy}{extra}"


def kl_figure(runs: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_kl, ax_beta) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        trainer = sorted(read(run / "trainer" / "metrics.jsonl"), key=lambda r: r["step"])
        config = (run / "configs" / "trainer.toml").read_text()
        target = next(float(line.split("=")[1]) for line in config.splitlines() if line.startswith("target"))
        steps = [r["step"] for r in trainer]
        (line,) = ax_kl.plot(steps, [r["kl_reward/kl_per_sample"] for r in trainer], label=f"{run.name}")
        ax_kl.axhline(target, color=line.get_color(), linestyle="--", alpha=0.6)
        ax_beta.plot(steps, [r["kl_reward/beta"] for r in trainer], label=run.name)
    ax_kl.set(title="KL(policy || start) per sample (dashed: target)", xlabel="step")
    ax_beta.set(title="beta (adaptive controller)", xlabel="step", yscale="log")
    for ax in (ax_kl, ax_beta):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=Path("outputs/algorithms"))
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if all((args.runs / name / "orchestrator" / "metrics.jsonl").is_file() for name in ("grpo", "gae")):
        plot_compare([args.runs / "grpo", args.runs / "gae"], args.out / "gae_vs_grpo.png")
    losses = [
        args.runs / name
        for name in LOSS_RUNS
        if (args.runs / name / "orchestrator" / "metrics.jsonl").is_file()
    ]
    if len(losses) > 1:
        plot_compare(losses, args.out / "losses.png")
    kl_runs = sorted(p for p in args.runs.glob("kl_adaptive*") if (p / "trainer" / "metrics.jsonl").is_file())
    if kl_runs:
        kl_figure(kl_runs, args.out / "kl_control.png")
    for run in sorted(p for p in args.runs.iterdir() if (p / "orchestrator" / "metrics.jsonl").is_file()):
        print(summary(run))


if __name__ == "__main__":
    main()
