"""Secret-looking values of a config are hidden wherever it is written or shown (the process configs
`rl` writes, W&B's run config, --dry-run, error messages), and the processes still get them, from a
file beside each written config that only its owner may read. (The SLURM job's config: slurm_job_test.)"""

import json
import stat
import sys
import types

import pytest
from config_test import parse_error
from plan_test import MACHINE

from prime_rl.config import RootConfig, parse_config
from prime_rl.config.cli import deep_merge
from prime_rl.config.files import secrets_path, write_config
from prime_rl.config.redact import PLACEHOLDER, is_secret_key, redact, secret_part
from prime_rl.launcher.config import RLConfig
from prime_rl.launcher.main import _dry_run
from prime_rl.launcher.plan import plan
from prime_rl.launcher.supervisor import Launcher
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.runtime.monitor import MetricsLogger, WandbConfig

KEY = "sk-judge-0123456789"

HIDDEN = ["api_key", "OPENAI_API_KEY", "hf_token", "access_token", "token", "password", "client_secret",
          "private_key", "apiKey", "HFToken", "headers", "extra_headers", "Authorization", "X-Api-Key",
          "Cookie", "PGPASSWORD", "passphrase", "ssh_passphrase", "jwt", "session_id", "sessionId"]  # fmt: skip
SHOWN = ["max_tokens", "max_new_tokens", "num_tokens", "tokenizer", "tokenizer_name", "key_dim", "seq_len",
         "api_key_file", "token_budget", "temperature", "id", "session", "session_count"]  # fmt: skip


def test_the_rule_hides_keys_that_name_a_secret_and_not_counts_or_tokenizers():
    assert [k for k in HIDDEN if not is_secret_key(k)] == []
    assert [k for k in SHOWN if is_secret_key(k)] == []


def test_redact_hides_at_any_depth_and_the_secret_part_puts_it_back():
    data = {
        "envs": [
            {"id": "judge", "args": {"api_key": KEY, "max_tokens": 5, "judge": {"headers": {"X-Id": "1"}}}},
            {"id": "plain", "args": {"tokenizer": "t"}},
        ],
        "seq_len": 512,
        "use_auth_token": True,  # says whether, not what
    }
    shown = redact(data)
    assert shown["envs"][0]["args"] == {
        "api_key": PLACEHOLDER,
        "max_tokens": 5,
        "judge": {"headers": PLACEHOLDER},
    }
    assert shown["envs"][1] == data["envs"][1] and shown["seq_len"] == 512 and shown["use_auth_token"] is True
    assert data["envs"][0]["args"]["api_key"] == KEY  # the input is left alone
    # A list is merged whole, so the part holds the whole list that holds a secret.
    assert secret_part(data) == {"envs": data["envs"]}
    assert deep_merge(shown, secret_part(data)) == data
    assert secret_part({"seq_len": 512, "args": {"max_tokens": 5}}) is None


def judge_run(out) -> RLConfig:
    """A run whose env's judge takes an API key as an env argument."""
    env = {"id": "reverse_text", "args": {"api_key": KEY, "max_tokens": 7}}
    return RLConfig(output_dir=out, orchestrator={"envs": [env]})


def test_rl_writes_its_configs_without_the_key_and_the_process_reads_it_back(tmp_path):
    config = judge_run(tmp_path / "run")
    p = plan(config, MACHINE)
    Launcher(config)._write_configs(p)
    written = tmp_path / "run" / "configs" / "orchestrator.toml"
    text = written.read_text()
    assert KEY not in text and f'api_key = "{PLACEHOLDER}"' in text and "max_tokens = 7" in text
    private = secrets_path(written)
    assert KEY in private.read_text() and stat.S_IMODE(private.stat().st_mode) == 0o600
    # The orchestrator is started reading both; parsed as it parses its command line, the key is back.
    [orchestrator] = [w for w in p.workers if w.name == "orchestrator"]
    assert orchestrator.command[1:] == ["@", str(written), "@", str(private)]
    assert parse_config(OrchestratorConfig, orchestrator.command[1:]) == p.orchestrator
    assert p.orchestrator.envs[0].args["api_key"] == KEY
    # The trainer's config holds no secret: one file, and none left beside it.
    [trainer] = [w for w in p.workers if w.name == "trainer"]
    assert trainer.command[-2:] == ["@", str(tmp_path / "run" / "configs" / "trainer.toml")]
    assert not secrets_path(tmp_path / "run" / "configs" / "trainer.toml").exists()


def test_a_secrets_file_is_private_even_over_an_old_one_and_goes_when_the_secret_does(tmp_path):
    path = tmp_path / "orchestrator.toml"
    secrets_path(path).write_text("old")
    secrets_path(path).chmod(0o644)
    config = judge_run(tmp_path).orchestrator
    assert write_config(path, config) == ["@", str(path), "@", str(secrets_path(path))]
    assert stat.S_IMODE(secrets_path(path).stat().st_mode) == 0o600 and KEY in secrets_path(path).read_text()
    assert write_config(path, OrchestratorConfig()) == ["@", str(path)]
    assert not secrets_path(path).exists()


def test_a_written_config_read_without_its_secrets_is_refused_naming_the_key(tmp_path, capsys):
    path = tmp_path / "orchestrator.toml"
    write_config(path, judge_run(tmp_path).orchestrator)
    err = parse_error(OrchestratorConfig, ["@", str(path)], capsys)
    assert "'envs[0].args.api_key'" in err and ".secrets.toml" in err and str(path) in err


def test_wandb_gets_the_run_config_with_the_key_hidden(tmp_path, monkeypatch):
    seen = {}
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: seen.update(kwargs) or types.SimpleNamespace()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = judge_run(tmp_path).orchestrator
    # As the orchestrator and the trainer hand their config over.
    MetricsLogger(
        tmp_path / "metrics.jsonl", WandbConfig(enabled=True), config=config.model_dump(mode="json")
    )
    assert seen["config"]["envs"][0]["args"] == {"api_key": PLACEHOLDER, "max_tokens": 7}
    assert KEY not in json.dumps(seen["config"])


def test_dry_run_shows_the_config_with_the_key_hidden(tmp_path, capsys):
    config = judge_run(tmp_path)
    assert KEY not in _dry_run(config) and PLACEHOLDER in _dry_run(config)
    path = tmp_path / "orchestrator.toml"
    path.write_text(f'[[envs]]\nid = "reverse_text"\nargs = {{ api_key = "{KEY}" }}\n')
    with pytest.raises(SystemExit):
        parse_config(OrchestratorConfig, ["@", str(path), "--dry-run"])
    out = capsys.readouterr().out
    assert KEY not in out and PLACEHOLDER in out


class Login(RootConfig):
    password: int
    """A secret-looking field."""


def test_an_error_about_a_secret_looking_value_does_not_show_it(capsys):
    err = parse_error(Login, ["--password", "hunter2-not-a-number"], capsys)
    assert "'password'" in err and "hunter2" not in err


def test_a_preflight_problem_with_an_envs_args_does_not_show_its_key():
    from prime_rl.orchestrator.preflight import env_problem

    problem = env_problem("envs[0]", "reverse_text", {"api_key": KEY, "max_tokens": 7})
    assert "does not accept them" in problem and KEY not in problem and PLACEHOLDER in problem
