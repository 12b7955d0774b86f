"""The config system as users meet it: files, flags, --help, --dry-run and errors."""

import subprocess
import sys
from pathlib import Path

import pytest

from prime_rl.config.cli import parse_config
from prime_rl.model.tiny import TinyModelConfig
from prime_rl.orchestrator.config import CustomAdvantage, OrchestratorConfig
from prime_rl.rl.config import RLConfig
from prime_rl.trainer.config import TrainerConfig

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def parse_error(cls, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_config(cls, argv, prog="prog")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_defaults_then_files_then_flags(tmp_path):
    a = write(tmp_path, "a.toml", "max_steps = 5\n[optim]\nlr = 0.1\nweight_decay = 0.5\n")
    b = write(tmp_path, "b.toml", "[optim]\nlr = 0.2\n")
    config = parse_config(TrainerConfig, ["@", str(a), f"@{b}", "--seed", "7"])
    assert config.max_steps == 5  # from a
    assert config.optim.lr == 0.2  # b wins over a
    assert config.optim.weight_decay == 0.5  # tables deep-merge: a's other keys stay
    assert config.seed == 7  # flag
    assert config.seq_len == TrainerConfig().seq_len  # default
    config = parse_config(TrainerConfig, ["@", str(a), "--optim.lr", "1e-5"])
    assert config.optim.lr == 1e-5  # flags win over files


def test_boolean_flags_and_structured_values():
    config = parse_config(TrainerConfig, ["--model.activation-checkpointing"])
    assert config.model.activation_checkpointing is True
    config = parse_config(
        TrainerConfig, ["--model.activation-checkpointing", "--no-model.activation-checkpointing"]
    )
    assert config.model.activation_checkpointing is False
    config = parse_config(TrainerConfig, ["--optim.betas", "[0.8, 0.9]", "--ckpt.interval=3"])
    assert config.optim.betas == (0.8, 0.9) and config.ckpt.interval == 3
    config = parse_config(OrchestratorConfig, ["--advantage", '{type = "custom", import_path = "m:f"}'])
    assert isinstance(config.advantage, CustomAdvantage)


def test_unknown_key_names_it_and_suggests(tmp_path, capsys):
    err = parse_error(TrainerConfig, ["--optim.lrr", "1"], capsys)
    assert "unknown key 'optim.lrr'" in err and "Did you mean 'optim.lr'" in err
    f = write(tmp_path, "t.toml", "[optim]\nweight_decai = 0.1\n")
    err = parse_error(TrainerConfig, ["@", str(f)], capsys)
    assert "optim.weight_decai" in err and str(f) in err and "optim.weight_decay" in err
    # A key at the wrong level is pointed to where it lives.
    err = parse_error(RLConfig, ["--lr", "1"], capsys)
    assert "trainer.optim.lr" in err


def test_wrong_type_and_bad_files(tmp_path, capsys):
    err = parse_error(TrainerConfig, ["--max-steps", "many"], capsys)
    assert "max_steps" in err and "'many'" in err and "integer" in err
    err = parse_error(TrainerConfig, ["@", str(tmp_path / "missing.toml")], capsys)
    assert "missing.toml" in err and "not found" in err
    bad = write(tmp_path, "bad.toml", "max_steps = = 3\n")
    err = parse_error(TrainerConfig, ["@", str(bad)], capsys)
    assert "bad.toml" in err and "not valid TOML" in err
    err = parse_error(TrainerConfig, ["stray"], capsys)
    assert "'stray'" in err


def test_rl_hands_shared_fields_down():
    config = parse_config(
        RLConfig, ["--max-steps", "7", "--model", "m", "--output-dir", "out", "--seq-len", "64"]
    )
    for sub in (config.trainer, config.orchestrator):
        assert (sub.max_steps, sub.model.name, str(sub.output_dir), sub.seq_len) == (7, "m", "out", 64)
    assert config.inference.model.name == "m"
    # One section repeating the value is fine; it is then taken everywhere.
    config = parse_config(RLConfig, ["--trainer.max-steps", "9"])
    assert config.max_steps == config.orchestrator.max_steps == 9


def test_rl_rejects_conflicting_shared_values(capsys):
    err = parse_error(RLConfig, ["--max-steps", "7", "--trainer.max-steps", "8"], capsys)
    assert "conflicting values for the shared setting 'max_steps'" in err
    assert "trainer.max_steps" in err
    err = parse_error(RLConfig, ["--trainer.model.name", "a", "--orchestrator.model.name", "b"], capsys)
    assert "'model'" in err


def test_every_field_has_a_docstring():
    from prime_rl.config.cli import _leaf_paths

    for cls in (RLConfig, TrainerConfig, OrchestratorConfig, TinyModelConfig):
        missing = [".".join(p) for p, info in _leaf_paths(cls) if not (info.description or "").strip()]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_dry_run_output_reads_back_to_the_same_config(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(RLConfig, ["@", str(REPO / "configs/reverse_text/rl.toml"), "--dry-run"])
    assert exc.value.code == 0
    dumped = write(tmp_path, "resolved.toml", capsys.readouterr().out)
    again = parse_config(RLConfig, ["@", str(dumped)])
    assert again == parse_config(RLConfig, ["@", str(REPO / "configs/reverse_text/rl.toml")])


@pytest.mark.parametrize("script", ["rl", "orchestrator", "trainer", "inference", "sft"])
def test_console_scripts_help(script):
    exe = Path(sys.executable).parent / script
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout and "--" in out.stdout
    # Every field's docstring is shown (spot check one per script).
    assert "[default:" in out.stdout


def test_console_script_user_error_exits_2_without_traceback():
    exe = Path(sys.executable).parent / "rl"
    out = subprocess.run(
        [exe, "@", str(REPO / "configs/reverse_text/rl.toml"), "--trainer.optim.lrr", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "trainer.optim.lrr" in out.stderr and "Traceback" not in out.stderr
