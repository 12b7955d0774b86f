"""Fault test: bad inputs, each through the console script a user runs, end in a one-line error that
names the culprit (field, file, env, function, URL or run), a non-zero exit and no traceback."""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from fake_server import MODEL, FakeServer, Reply
from prime_rl.runtime.net import free_port
from prime_rl.transport.messages import Header, MicroBatch
from prime_rl.transport.zmq_transport import ZmqSender

BIN = Path(sys.executable).parent
ENVS = str(Path(__file__).parents[1] / "envs")


def run(script: str, *args, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ENVS}
    return subprocess.run([str(BIN / script), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)  # fmt: skip


def run_until_error(script: str, *args, cwd: Path) -> subprocess.CompletedProcess:
    """A command with a mistake that must be caught before `rl` starts anything (no inference, no
    trainer: the checks run first). Not timed: how long imports take depends on the machine."""
    out = run(script, "--output-dir", "out", *args, cwd=cwd)
    assert "starting inference" not in out.stdout + out.stderr
    assert not (cwd / "out" / "logs").exists() or not any((cwd / "out" / "logs").iterdir()), (
        "a process started"
    )
    return out


def assert_clear_error(out: subprocess.CompletedProcess, code: int, *phrases: str) -> None:
    assert out.returncode == code, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    for phrase in phrases:
        assert phrase in out.stderr, (phrase, out.stderr[-3000:])


def test_malformed_toml_names_the_file(tmp_path):
    (tmp_path / "bad.toml").write_text("[client\nbase_urls = 1\n")
    assert_clear_error(run("orchestrator", "@", "bad.toml", cwd=tmp_path), 2, "bad.toml", "not valid TOML")


def test_unknown_key_is_named_with_a_suggestion(tmp_path):
    (tmp_path / "orch.toml").write_text('[client]\nbase_url = "http://x:8000/v1"\n')
    out = run("orchestrator", "@", "orch.toml", cwd=tmp_path)
    assert_clear_error(
        out, 2, "unknown key 'client.base_url'", "orch.toml", "Did you mean 'client.base_urls'"
    )


def test_wrong_type_names_the_field_and_the_expected_type(tmp_path):
    out = run("orchestrator", "--batch-size", "many", cwd=tmp_path)
    assert_clear_error(out, 2, "'batch_size' = 'many'", "integer")


@pytest.mark.parametrize("script", ["inference", "rl"])
def test_missing_model_folder_is_named(tmp_path, script):
    flag = "--model.name" if script == "inference" else "--model"
    out = run(script, flag, "./models/nope", cwd=tmp_path)
    assert_clear_error(out, 2, "no model folder at './models/nope'")


def test_model_folder_that_is_not_a_model_config_is_named(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"hidden_size": 8}')
    assert_clear_error(run("rl", "--model", "./m", cwd=tmp_path), 2, "'model' = './m'", "no 'model_type'")
    (tmp_path / "m" / "config.json").write_text("{hidden_size: 8")
    assert_clear_error(
        run("trainer", "--model.name", "./m", cwd=tmp_path), 2, "'model.name'", "not valid JSON"
    )


@pytest.mark.parametrize("script", ["inference", "rl"])
def test_max_model_len_beyond_the_model_is_named(tmp_path, short_context_model, script):
    prefix = "inference." if script == "rl" else ""
    model = ["--model", short_context_model] if script == "rl" else ["--model.name", short_context_model]
    out = run_until_error(script, *model, f"--{prefix}model.max-model-len", "1024", cwd=tmp_path)
    assert_clear_error(
        out, 2, f"'{prefix}model.max_model_len' = '1024'", "512 tokens (max_position_embeddings"
    )


@pytest.mark.parametrize(
    ("args", "phrases"),
    [
        (["--orchestrator.envs", '[{id = "nope-env"}]'],
         ["orchestrator.envs[0].id = 'nope-env'", "no module 'nope_env'"]),
        (["--orchestrator.eval.envs", '[{id = "custom-advantages"}]'],
         ["orchestrator.eval.envs[0].id = 'custom-advantages'", "exports no verifiers.v1 Taskset"]),
        (["--orchestrator.envs", '[{id = "reverse-text", args = {nope = 1}}]'],
         ["orchestrator.envs[0].args = {'nope': 1}", "nope: Extra inputs are not permitted"]),
        (["--orchestrator.advantage.type", "no_such_module:fn"],
         ["orchestrator.advantage.type = 'no_such_module:fn'", "cannot import 'no_such_module'"]),
        (["--trainer.loss.type", "custom_advantages:no_such_fn"],
         ["trainer.loss.type = 'custom_advantages:no_such_fn'", "no function 'no_such_fn'"]),
        (["--trainer.advantage.type", "custom_advantages:no_such_fn"],
         ["trainer.advantage.type = 'custom_advantages:no_such_fn'", "no function 'no_such_fn'"]),
        (["--trainer.advantage.gamma", "1.5"], ["'trainer.advantage.gamma' = '1.5'", "less than or equal to 1"]),
        (["--trainer.advantage.type", "gae", "--trainer.advantage.lam", "-0.1"],
         ["'trainer.advantage.lam' = '-0.1'", "greater than or equal to 0"]),
        (["--trainer.advantage.lam", "0.5"], ["'trainer.advantage.lam' = '0.5'", "not a setting of type = 'reinforce'"]),
        (["--trainer.critic.path", "./no_such_critic"], ["'trainer.critic.path' = './no_such_critic'", "no model folder"]),
        (["--trainer.advantage.type", "gae"], ["'trainer.advantage.type' = 'gae' trains the critic on every group",
                                               "'orchestrator.filters[0].type' = 'zero_advantage' drops groups"]),
        (["--trainer.advantage.type", "gae", "--orchestrator.filters", "[]", "--orchestrator.dynamic-sampling.enabled",
          "true"], ["'orchestrator.dynamic_sampling.enabled' = true drops groups"]),
        (["--orchestrator.advantage.type", "reinforce_baseline"],
         ["'orchestrator.advantage.type' = 'reinforce_baseline' is whitened", "'trainer.advantage.batch_normalize'"]),
        (["--seq-len", "2048", "--orchestrator.envs", '[{id = "reverse-text", sampling.max_tokens = 1024}]'],
         ["'orchestrator.envs[0].sampling.max_tokens' = 1024", "max_model_len' = 1024"]),
    ],
)  # fmt: skip
def test_rl_names_a_mistake_before_it_starts_inference(tmp_path, args, phrases):
    assert_clear_error(run_until_error("rl", *args, cwd=tmp_path), 2, *phrases)


def test_orchestrator_and_trainer_alone_check_env_ids_and_import_paths(tmp_path):
    out = run_until_error("orchestrator", "--envs", '[{id = "no-such-env"}]', cwd=tmp_path)
    assert_clear_error(out, 2, "envs[0].id = 'no-such-env'", "no module 'no_such_env'")
    # (Not timed: the trainer imports torch, seconds on a slow machine, before it parses its config.)
    out = run("trainer", "--loss.type", "no_such_module:loss", cwd=tmp_path)
    assert_clear_error(out, 2, "loss.type = 'no_such_module:loss'", "cannot import")


@pytest.mark.parametrize(
    ("import_path", "phrases"),
    [
        ("custom_advantages:wrong_length", ["returned 1 advantages for a group of 4", "env 'reverse-text'"]),
        ("custom_advantages:not_finite", ["non-finite", "custom_advantages:not_finite"]),
    ],
)
def test_bad_custom_advantage_is_named(tmp_path, import_path, phrases):
    with FakeServer() as server:
        out = run(
            "orchestrator", "--model.name", MODEL, "--output-dir", "out", "--max-steps", "1", "--batch-size", "8",
            "--envs", '[{id = "reverse-text", group_size = 4}]',
            "--advantage.type", import_path,
            "--client.base-urls", f'["{server.base_url}"]', "--transport.type", "filesystem",
            cwd=tmp_path,
        )  # fmt: skip
    assert_clear_error(out, 2, *phrases)


@pytest.mark.parametrize(
    ("env", "reply", "code", "reason"),
    [
        ("failing-env", Reply(), 2, "ValueError"),  # an env bug: its reward raises
        ("reverse-text", Reply(status=500), 1, "InternalServerError"),  # the server refuses everything
    ],
)
def test_an_env_whose_every_rollout_fails_stops_the_orchestrator_with_one_line(
    tmp_path, env, reply, code, reason
):
    # The orchestrator stops once 3 groups in a row failed entirely, instead of retrying forever;
    # exit status 2 (never retried) for the env's own error, 1 for a server's.
    with FakeServer(lambda req, i: reply) as server:
        out = run(
            "orchestrator", "--model.name", MODEL, "--output-dir", "out", "--max-steps", "5", "--batch-size", "8",
            "--max-failed-groups", "3", "--envs", f'[{{id = "{env}", group_size = 4}}]',
            "--client.base-urls", f'["{server.base_url}"]', "--transport.type", "filesystem",
            cwd=tmp_path,
        )  # fmt: skip
        requests = len(server.requests)
    assert_clear_error(out, code, f"env '{env}': the last 3 groups failed entirely",
                       "most common reason: ", reason, "orchestrator.max_failed_groups = 3")  # fmt: skip
    assert len([line for line in out.stderr.splitlines() if line.startswith("orchestrator: error:")]) == 1
    # Bounded by the failure count, not by time: a retry loop would have sent far more.
    assert requests < 200, requests


def test_an_inference_url_that_never_answers_is_named(tmp_path):
    # A socket that completes TCP handshakes (the kernel does) but never answers HTTP.
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        url = f"http://127.0.0.1:{hole.getsockname()[1]}/v1"
        out = run("orchestrator", "--model.name", MODEL, "--output-dir", "out", "--client.base-urls", f'["{url}"]',
                  "--client.health-timeout-s", "1", cwd=tmp_path)  # fmt: skip
    assert_clear_error(out, 1, f"inference server {url.removesuffix('/v1')} was not healthy after 1 s")


def test_a_zmq_peer_from_another_run_is_refused(tmp_path, tiny_model):
    port = free_port()
    sender = ZmqSender(f"tcp://127.0.0.1:{port}", timeout_s=120)
    # The trainer connects and waits; the message it gets was stamped by another run.
    a = np.array
    mb = MicroBatch.from_arrays(Header("someone-else", 0), 0, 1, a([1, 2]), a([0, 1]), a([0, 1]),
                                a([0.0, -1.0]), [2], ["env"])  # fmt: skip
    threading.Thread(target=sender.send, args=(mb,), daemon=True).start()
    out = run("trainer", "--model.name", tiny_model, "--output-dir", "out", "--transport.port", port,
              "--transport.run-id", "mine", "--max-steps", "1", cwd=tmp_path)  # fmt: skip
    sender.close(linger_s=0)
    assert_clear_error(
        out, 1, "received a message of run 'someone-else'", "this is run 'mine'", "transport.port"
    )


@pytest.mark.parametrize(
    ("path", "phrases"),
    [
        ("./no_such_rm", ["envs[0].rewards[0].path: './no_such_rm' is not a model folder"]),
        ("MODELS/reverse_text-tiny", ["envs[0].rewards[0].path", "holds a Qwen3ForCausalLM",
                                      "a reward model is a *ForSequenceClassification with one output"]),
    ],
)  # fmt: skip
def test_a_reward_model_path_that_does_not_load_is_named(tmp_path, path, phrases):
    path = path.replace("MODELS", str(Path(__file__).parents[2] / "models"))
    envs = f'[{{id = "reverse-text", rewards = [{{type = "reward_model", path = "{path}"}}]}}]'
    assert_clear_error(run_until_error("orchestrator", "--envs", envs, cwd=tmp_path), 2, *phrases)


def test_a_reward_model_url_that_never_answers_is_named(tmp_path):
    with socket.socket() as hole:  # accepts connections, never answers
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        url = f"http://127.0.0.1:{hole.getsockname()[1]}"
        envs = f'[{{id = "reverse-text", rewards = [{{type = "reward_model", url = "{url}", connect_timeout_s = 1}}]}}]'
        out = run("orchestrator", "--model.name", MODEL, "--output-dir", "out", "--envs", envs, cwd=tmp_path)
    assert_clear_error(out, 2, f"envs[0].rewards[0].url: {url} did not answer within 1s")


def test_a_teacher_whose_tokenizer_differs_from_the_students_is_named(tmp_path):
    models = Path(__file__).parents[2] / "models"
    teacher = tmp_path / "teacher"
    shutil.copytree(models / "sum_digits-tiny", teacher)
    tok = json.loads((teacher / "tokenizer.json").read_text())
    tok["model"]["vocab"]["zzz"] = len(tok["model"]["vocab"])
    (teacher / "tokenizer.json").write_text(json.dumps(tok))
    out = run_until_error(
        "rl", "--model", str(models / "sum_digits-tiny"), "--teacher.model.name", str(teacher),
        "--orchestrator.filters", "[]", cwd=tmp_path,
    )  # fmt: skip
    assert_clear_error(out, 2, f"teacher.model.name = '{teacher}'", "differs from the student's",
                       "must share the student's tokenizer")  # fmt: skip
