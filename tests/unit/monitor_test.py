"""Metrics go to JSONL always, and to W&B when enabled: offline without an API key, never blocking."""

import json

import pytest

from prime_rl.runtime.monitor import MetricsLogger, WandbConfig, forget_steps_from, read_metrics


@pytest.fixture
def offline_wandb(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    # W&B's own error reporting runs two OpenTelemetry threads for the rest of the process.
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    yield
    import wandb

    # A finished run leaves W&B's service (a process and its threads) up for the next `wandb.init`:
    # stop it here, or it would run through every later test.
    wandb.teardown()


def test_wandb_without_a_key_logs_offline_next_to_the_metrics(tmp_path, offline_wandb):
    path = tmp_path / "orchestrator" / "metrics.jsonl"
    logger = MetricsLogger(path, WandbConfig(enabled=True, name="t"), config={"lr": 0.1})
    assert logger._wandb is not None and logger._wandb.settings.mode == "offline"
    logger.log(0, {"reward/all/mean": 0.5, "nan": float("nan")})
    logger.log(1, {"reward/all/mean": 0.7})
    logger.close()
    assert [r["reward/all/mean"] for r in read_metrics(path)] == [0.5, 0.7]
    assert json.loads(path.read_text().splitlines()[0])["nan"] is None  # JSON has no NaN
    runs = [p for p in (tmp_path / "orchestrator" / "wandb").iterdir() if p.name.startswith("offline-run")]
    assert len(runs) == 1 and any(f.suffix == ".wandb" for f in runs[0].iterdir())


def test_forget_steps_from_drops_the_steps_to_be_logged_again_but_keeps_evals(tmp_path):
    path = tmp_path / "metrics.jsonl"
    logger = MetricsLogger(path)
    for step in range(4):
        logger.log(step, {"loss": float(step)})
    logger.log(3, {"eval/e/reward/mean": 0.5, "eval/policy_version": 3}, axis="eval/step")
    assert forget_steps_from(path, 2) == 2
    assert [(r["step"], "loss" in r) for r in read_metrics(path)] == [(0, True), (1, True), (3, False)]
    assert forget_steps_from(path, 2) == 0 and forget_steps_from(tmp_path / "none.jsonl", 0) == 0


def test_forget_steps_from_can_drop_evals_and_repairs_a_half_written_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    logger = MetricsLogger(path)
    logger.log(0, {"eval/e/reward/mean": 0.5}, axis="eval/step")
    logger.log(0, {"loss": 1.0})
    with path.open("a") as f:
        f.write('{"step": 1, "lo')  # killed mid-write
    assert forget_steps_from(path, 1) == 0
    assert path.read_text().endswith("}\n")  # the next record starts on a line of its own
    logger.log(1, {"loss": 2.0})
    assert [r["step"] for r in read_metrics(path)] == [0, 0, 1]
    assert forget_steps_from(path, 0, evals=True) == 3 and read_metrics(path) == []
