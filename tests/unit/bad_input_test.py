"""Fault test: bad inputs, each through the console script a user runs, end in a one-line error that
names the culprit (field, file, env, function, URL or run), a non-zero exit and no traceback."""

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from fake_server import FakeServer
from prime_rl.net import free_port
from prime_rl.transport.messages import Header, MicroBatch
from prime_rl.transport.zmq_transport import ZmqSender

BIN = Path(sys.executable).parent
ENVS = str(Path(__file__).parents[1] / "envs")


def run(script: str, *args, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ENVS}
    return subprocess.run([str(BIN / script), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)  # fmt: skip


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


def test_bad_env_id_is_named(tmp_path):
    out = run("orchestrator", "--envs", '[{id = "no-such-env"}]', "--output-dir", "out", cwd=tmp_path)
    assert_clear_error(out, 1, "env 'no-such-env' could not be loaded", "load_environment")


@pytest.mark.parametrize(
    ("import_path", "phrases"),
    [
        ("no_such_module:fn", ["cannot import 'no_such_module'"]),
        ("custom_advantages:wrong_length", ["returned 1 advantages for a group of 4", "env 'reverse-text'"]),
        ("custom_advantages:not_finite", ["non-finite", "custom_advantages:not_finite"]),
    ],
)
def test_bad_custom_advantage_is_named(tmp_path, import_path, phrases):
    with FakeServer() as server:
        out = run(
            "orchestrator", "--output-dir", "out", "--max-steps", "1", "--batch-size", "8",
            "--envs", '[{id = "reverse-text", group_size = 4}]',
            "--advantage", f'{{type = "custom", import_path = "{import_path}"}}',
            "--client.base-urls", f'["{server.base_url}"]', "--transport.type", "filesystem",
            cwd=tmp_path,
        )  # fmt: skip
    assert_clear_error(out, 1, *phrases)


def test_an_inference_url_that_never_answers_is_named(tmp_path):
    # A socket that completes TCP handshakes (the kernel does) but never answers HTTP.
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        url = f"http://127.0.0.1:{hole.getsockname()[1]}/v1"
        out = run("orchestrator", "--output-dir", "out", "--client.base-urls", f'["{url}"]',
                  "--client.health-timeout-s", "1", cwd=tmp_path)  # fmt: skip
    assert_clear_error(out, 1, f"inference server {url.removesuffix('/v1')} was not healthy after 1 s")


def test_a_zmq_peer_from_another_run_is_refused(tmp_path, tiny_model):
    port = free_port()
    sender = ZmqSender(f"tcp://127.0.0.1:{port}", timeout_s=120)
    # The trainer connects and waits; the message it gets was stamped by another run.
    a = np.array
    mb = MicroBatch.from_arrays(Header("someone-else", 0), 0, 1, a([1, 2]), a([0, 1]), a([0, 1]), a([0.0, 1.0]),
                                a([0.0, -1.0]), [2], ["env"])  # fmt: skip
    threading.Thread(target=sender.send, args=(mb,), daemon=True).start()
    out = run("trainer", "--model.name", tiny_model, "--output-dir", "out", "--transport.port", port,
              "--transport.run-id", "mine", "--max-steps", "1", cwd=tmp_path)  # fmt: skip
    sender.close(linger_s=0)
    assert_clear_error(
        out, 1, "received a message of run 'someone-else'", "this is run 'mine'", "transport.port"
    )
