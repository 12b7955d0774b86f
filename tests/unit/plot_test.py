"""`plot` draws a run's metrics JSONL to PNG, once per step, and says clearly when there is nothing."""

import json
from pathlib import Path

import pytest

from prime_rl.plot import by_step, main
from prime_rl.runtime.monitor import read_metrics


def write_metrics(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_resumed_step_is_drawn_once_with_its_latest_record():
    records = [
        {"step": 0, "loss": 1.0},
        {"step": 1, "loss": 0.9},
        {"step": 1, "loss": 0.7},  # logged again after a resume
        {"step": 2, "eval/policy_version": 2, "eval/e/reward/mean": 0.5},
    ]
    rows = by_step(records)
    assert list(rows) == [0, 1]
    assert rows[1]["loss"] == 0.7


def test_plot_writes_a_png_from_an_output_dir(tmp_path, capsys):
    out = tmp_path / "run"
    write_metrics(
        out / "orchestrator" / "metrics.jsonl",
        [
            {"step": s, "reward/all/mean": 0.1 * s, "reward/e/mean": 0.1 * s, "time/generate": 1.0}
            for s in range(3)
        ],
    )
    write_metrics(
        out / "trainer" / "metrics.jsonl",
        [{"step": s, "loss": 1.0 - s, "mismatch_kl/all/mean": 1e-4, "time/train": 2.0} for s in range(3)],
    )
    main(["--output_dir", str(out)])
    png = out / "plots.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(png) in capsys.readouterr().out


def test_a_running_process_half_written_line_is_left_out(tmp_path):
    path = tmp_path / "trainer" / "metrics.jsonl"
    write_metrics(path, [{"step": 0, "loss": 1.0}])
    with path.open("a") as f:
        f.write('{"step": 1, "lo')  # the trainer is in the middle of writing step 1
    assert by_step(read_metrics(path)) == {0: {"step": 0, "loss": 1.0}}


def test_plot_of_a_dir_without_metrics_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--output_dir", str(tmp_path), "--out", str(tmp_path / "x.png")])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "no metrics under" in err and "Traceback" not in err
    assert not (tmp_path / "x.png").exists()


def test_compare_draws_several_runs_and_names_one_without_metrics(tmp_path, capsys):
    for name, slope in (("grpo", 0.1), ("gae", 0.2)):
        write_metrics(
            tmp_path / name / "orchestrator" / "metrics.jsonl",
            [{"step": s, "reward/e/mean": slope * s} for s in range(3)]
            + [{"step": 2, "eval/policy_version": 2, "eval/e-eval/reward/mean": slope}],
        )
    out = tmp_path / "both.png"
    main(["--compare", json.dumps([str(tmp_path / "grpo"), str(tmp_path / "gae")]), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        main(
            ["--compare", json.dumps([str(tmp_path / "grpo"), str(tmp_path / "nothing")]), "--out", str(out)]
        )
    assert "nothing" in capsys.readouterr().err
