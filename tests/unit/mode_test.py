"""`deployment.inference_mode = "auto"` (the default): `rl` serves the policy with vLLM's engine in the
orchestrator's process where an explicit "engine" would be accepted, with a server otherwise, and says
which in one line."""

import re

import pytest

from prime_rl.launcher.config import RLConfig
from prime_rl.launcher.mode import resolve

V1 = [{"id": "v1_test_env", "sampling": {"max_tokens": 16}}]


def test_a_one_machine_run_is_served_by_the_engine_and_the_line_says_so():
    config, line = resolve(RLConfig())
    assert config.deployment.inference_mode == "engine"
    assert line == (
        "rl: policy served by vLLM's engine in the orchestrator's process "
        "(deployment.inference_mode = auto: one machine, nothing against the engine)"
    )
    assert RLConfig().deployment.inference_mode == "auto"  # the given config is not changed
    # verifiers v1 envs included: the orchestrator plays their seats, token ids straight to the engine.
    config, _ = resolve(RLConfig(orchestrator={"envs": V1, "eval": {"envs": V1}}))
    assert config.deployment.inference_mode == "engine"


@pytest.mark.parametrize(
    "config, why",
    [
        ({"orchestrator": {"env_workers": 2}}, "orchestrator.env_workers = 2"),
        ({"deployment": {"inference_servers": 2}}, "deployment.inference_servers = 2"),
        ({"trainer": {"lora": {"rank": 8}}}, r"\[trainer.lora\] is set"),
        ({"deployment": {"inference_urls": ["http://10.0.0.5:8000"]}}, "deployment.inference_urls is set"),
        ({"trainer": {"weight_broadcast": {"type": "collective"}}}, "weight_broadcast.type = 'collective'"),
    ],
)
def test_a_run_the_engine_cannot_serve_gets_a_server_and_the_line_names_why(config, why):
    resolved, line = resolve(RLConfig(**config))
    assert resolved.deployment.inference_mode == "server"
    assert line.startswith("rl: policy served by a vLLM server (deployment.inference_mode = auto: ")
    assert re.search(why, line), line


@pytest.mark.parametrize("mode", ["server", "engine"])
def test_an_explicit_mode_is_kept(mode):
    config, line = resolve(RLConfig(deployment={"inference_mode": mode}))
    assert config.deployment.inference_mode == mode
    assert line.endswith("(deployment.inference_mode)")
