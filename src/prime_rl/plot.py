"""`uv run plot --output_dir outputs/reverse_text`: draw a run's curves to one PNG; with
`--compare '["outputs/a", "outputs/b"]'`, several runs' reward curves on common axes.

Reads only the metrics JSONL files under the output dir (orchestrator/ and trainer/), so it works on
a finished run, a running one, or one copied from another machine. A step logged twice (a resumed
run logs the steps after its checkpoint again) is drawn once, with its latest record.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from prime_rl.config import RootConfig, parse_config
from prime_rl.config.defaults import DEFAULT_OUTPUT_DIR
from prime_rl.runtime.monitor import read_metrics

# Step-time parts, each drawn as a stacked band: (process, metric key, label).
TIME_PARTS = [
    ("orchestrator", "time/generate", "orchestrator: generate"),
    ("orchestrator", "time/wait_trainer", "orchestrator: wait for trainer"),
    ("orchestrator", "time/reload", "orchestrator: weight reload"),
    ("trainer", "time/wait_for_data", "trainer: wait for data"),
    ("trainer", "time/train", "trainer: train"),
]


class PlotConfig(RootConfig):
    """plot: reward, loss, mismatch KL and step-time curves of a run, as a PNG."""

    output_dir: Path = Path(DEFAULT_OUTPUT_DIR)
    """The run's output dir (the `output_dir` of its rl config)."""

    out: Path | None = None
    """Where to write the PNG (default: <output_dir>/plots.png, or compare.png in the current folder)."""

    compare: list[Path] = []
    """Runs to draw together instead (their sampled and eval rewards, per env); output_dir is ignored."""


class PlotError(RuntimeError):
    """The output dir holds no metrics to draw."""


def by_step(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Training-step records keyed by step; a later record of the same step replaces the earlier."""
    out: dict[int, dict[str, Any]] = {}
    for r in records:
        if not any(k.startswith("eval/") for k in r):
            out[int(r["step"])] = r
    return dict(sorted(out.items()))


def eval_records(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return dict(sorted((int(r["step"]), r) for r in records if "eval/policy_version" in r))


def eval_envs(evals: dict[int, dict[str, Any]]) -> list[str]:
    """Eval env names (they may differ from the training envs', e.g. "sum-digits-eval")."""
    return sorted(
        {
            k.split("/")[1]
            for r in evals.values()
            for k in r
            if k.startswith("eval/") and k.endswith("/reward/mean")
        }
    )


def moving_mean(values: list[float], window: int) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1))
        for i in range(len(values))
    ]


def series(rows: dict[int, dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps = [s for s, r in rows.items() if r.get(key) is not None]
    return steps, [float(rows[s][key]) for s in steps]


def load_run(output_dir: Path) -> dict[str, list[dict[str, Any]]]:
    runs = {}
    for proc in ("orchestrator", "trainer"):
        path = Path(output_dir) / proc / "metrics.jsonl"
        runs[proc] = read_metrics(path) if path.is_file() else []
    if not any(runs.values()):
        raise PlotError(
            f"no metrics under '{output_dir}': expected orchestrator/metrics.jsonl or trainer/metrics.jsonl "
            "(is output_dir the run's output dir?)"
        )
    return runs


def plot(output_dir: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    runs = load_run(output_dir)
    orch, trainer = by_step(runs["orchestrator"]), by_step(runs["trainer"])
    evals = eval_records(runs["orchestrator"])
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ax_reward, ax_loss), (ax_kl, ax_time) = axes

    envs = sorted({k.split("/")[1] for r in orch.values() for k in r if k.startswith("reward/")} - {"all"})
    for env in envs:
        ax_reward.plot(*series(orch, f"reward/{env}/mean"), label=f"{env} (train rollouts)")
    for env in eval_envs(evals):
        ax_reward.plot(*series(evals, f"eval/{env}/reward/mean"), "o--", label=f"{env} (eval)")
    ax_reward.set(title="reward (mean)", xlabel="step")

    ax_loss.plot(*series(trainer, "loss"), label="loss")
    ax_loss.set(title="trainer loss", xlabel="step")

    steps, kl = series(trainer, "mismatch_kl/all/mean")
    ax_kl.plot(steps, kl, label="mean")
    if kl and all(v > 0 for v in kl):
        ax_kl.set_yscale("log")
    ax_kl.set(title="mismatch KL (trainer vs inference logprobs)", xlabel="step")

    bottom: dict[tuple[str, int], float] = {}
    for proc, key, label in TIME_PARTS:
        rows = orch if proc == "orchestrator" else trainer
        steps, values = series(rows, key)
        if not steps:
            continue
        base = [bottom.get((proc, s), 0.0) for s in steps]
        # Orchestrator parts stack on the left half of each step, trainer parts on the right.
        offset = -0.2 if proc == "orchestrator" else 0.2
        ax_time.bar([s + offset for s in steps], values, width=0.4, bottom=base, label=label)
        for s, b, v in zip(steps, base, values, strict=True):
            bottom[(proc, s)] = b + v
    ax_time.set(title="step time (s): orchestrator | trainer", xlabel="step")

    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(str(output_dir))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_compare(output_dirs: list[Path], out: Path) -> Path:
    """Sampled reward per step (left) and eval reward (right) of each run, one line per run and env."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(12, 4.5))
    for output_dir in output_dirs:
        records = load_run(output_dir)["orchestrator"]
        orch, evals = by_step(records), eval_records(records)
        name = Path(output_dir).name
        envs = sorted(
            {k.split("/")[1] for r in orch.values() for k in r if k.startswith("reward/")} - {"all"}
        )
        for env in envs:
            label = name if len(envs) == 1 else f"{name}: {env}"
            steps, values = series(orch, f"reward/{env}/mean")
            (line,) = ax_train.plot(steps, moving_mean(values, 5), label=label)
            ax_train.plot(steps, values, color=line.get_color(), alpha=0.25)
        evs = eval_envs(evals)
        for env in evs:
            ax_eval.plot(
                *series(evals, f"eval/{env}/reward/mean"),
                "o-",
                label=name if len(evs) == 1 else f"{name}: {env}",
            )
    ax_train.set(
        title="reward of the sampled rollouts (faint: per step; line: mean of the last 5)", xlabel="step"
    )
    ax_eval.set(title="held-out eval reward (greedy)", xlabel="step")
    for ax in (ax_train, ax_eval):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    config = parse_config(PlotConfig, argv, prog="plot")
    try:
        if config.compare:
            out = config.out or Path("compare.png")
            plot_compare([Path(p) for p in config.compare], Path(out))
        else:
            out = config.out or Path(config.output_dir) / "plots.png"
            plot(Path(config.output_dir), Path(out))
    except PlotError as e:
        print(f"plot: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"plot: wrote {out}")
