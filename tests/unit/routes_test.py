"""Routes from the server to the sample: both encodings decode, each token takes its routes from the
first call that forwarded it, a rollout without routes is one line naming the key, and a server that
cannot return them is refused before anything starts."""

import base64
import io
from pathlib import Path

import numpy as np
import pytest

from helpers.scripted import play
from prime_rl.config import ConfigError
from prime_rl.engine.server import server_command
from prime_rl.inference.config import InferenceConfig
from prime_rl.inference.preflight import inference_problems
from prime_rl.launcher.config import RLConfig
from prime_rl.launcher.preflight import check_rl
from prime_rl.orchestrator.envs.routes import decode_routes
from prime_rl.orchestrator.loop.samples import RoutesMissing, rollout_to_samples
from prime_rl.orchestrator.rollout import Rollout, Turn

LAYERS, K, EXPERTS = 2, 2, 8


def npy_b64(routes: np.ndarray) -> str:
    """vLLM's encoding of `routed_experts` in a chat response."""
    buffer = io.BytesIO()
    np.save(buffer, routes, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def table(rows: int, first: int) -> np.ndarray:
    """Routes whose every entry says which row of the sequence (from `first`) it routes, mod 8."""
    ids = (np.arange(first, first + rows) % EXPERTS).astype(np.uint8)
    return np.repeat(ids[:, None, None], LAYERS * K, axis=1).reshape(rows, LAYERS, K)


def test_both_encodings_decode():
    routes = table(5, 0)
    got, start = decode_routes(npy_b64(routes))
    assert start == 0 and np.array_equal(got, routes)
    sidecar = {
        "data": base64.b64encode(routes.tobytes()),
        "shape": [5, LAYERS, K],
        "dtype": "uint8",
        "start": 3,
    }
    got, start = decode_routes(sidecar)
    assert start == 3 and np.array_equal(got, routes)
    assert decode_routes(None) is None
    with pytest.raises(ValueError, match="integer \\[tokens, layers, top-k\\]"):
        decode_routes(npy_b64(np.zeros((3, 2))))


def test_a_servers_routes_reach_the_turn_and_unreadable_ones_fail_the_call():
    from prime_rl.orchestrator.envs.sampler import ServerSampler

    choice = {"token_ids": [4, 5], "logprobs": {"token_logprobs": [-0.1, -0.2]}, "text": "ab",
              "finish_reason": "stop", "routed_experts": npy_b64(table(4, 0))}  # fmt: skip
    completion = ServerSampler._completion(choice, 3)
    assert completion.routes.shape == (4, LAYERS, K) and completion.version == 3
    choice["routed_experts"] = "not base64 of an npy file"
    with pytest.raises(ValueError):
        ServerSampler._completion(choice, 3)
    # Through a rollout: each call's routes on its turn.
    (rollout,), _ = play(
        "reverse-text",
        ["abc"],
        str(Path(__file__).parents[2] / "models" / "reverse_text-tiny"),
        routes=table(40, 0),
    )
    assert rollout.turns[0].routes.shape == (40, LAYERS, K)


def test_multi_turn_tokens_take_the_routes_of_the_call_that_first_forwarded_them():
    """Call 1 forwards prompt (3) + its completion (2, the last unforwarded); call 2's prompt adds 2
    env tokens. Call 1's rows say 'call 1' (expert 1), call 2's say 'call 2' (expert 2)."""
    call1 = Turn([10, 11, 12], [13, 14], [1, 1], [-0.1, -0.1], routes=np.full((4, LAYERS, K), 1, np.uint8))
    call2 = Turn([10, 11, 12, 13, 14, 15, 16], [17, 18], [1, 1], [-0.1, -0.1],
                 routes=np.full((8, LAYERS, K), 2, np.uint8))  # fmt: skip
    rollout = Rollout("e", 0, 0, reward=1.0, turns=[call1, call2])
    [sample] = rollout_to_samples(rollout, 1.0, num_experts=EXPERTS)
    routes = sample.route_array()[:, 0, 0].tolist()
    # Tokens 0-3 from call 1 (token 13 was sampled by call 1); 14 first forwarded by call 2, as are
    # the env tokens 15-16 and 17; the last token (18) repeats 17's.
    assert routes == [1, 1, 1, 1, 2, 2, 2, 2, 2]
    assert sample.route_shape == [LAYERS, K] and sample.route_dtype == "u1"
    sample.validate()


def test_a_rollout_without_routes_is_one_line_naming_the_key():
    rollout = Rollout("e", 7, 0, turns=[Turn([1, 2], [3], [1], [-0.1])])
    with pytest.raises(RoutesMissing, match=r"^orchestrator.return_routes = true, but a rollout of env 'e', example 7 came without them: the server returned no routed experts\. Start vLLM with --enable-return-routed-experts"):  # fmt: skip
        rollout_to_samples(rollout, 1.0, num_experts=EXPERTS)
    gap = Rollout("e", 7, 0, turns=[Turn([1, 2, 3], [4], [1], [-0.1], routes=table(2, 1), routes_start=1)])
    with pytest.raises(RoutesMissing, match=r"1 of 4 tokens have no routes \(first at position 0\)"):
        rollout_to_samples(gap, 1.0, num_experts=EXPERTS)
    assert rollout_to_samples(rollout, 1.0)[0].routes == b""  # routes not asked for: none carried


def test_the_server_is_asked_for_routes_and_vllm_cpu_refuses_in_one_line(tiny_moe_model, monkeypatch):
    config = InferenceConfig(model={"name": str(tiny_moe_model)}, return_routes=True)
    assert "--enable-return-routed-experts" in server_command(config, cpu_build=False)
    assert inference_problems(config, cpu_build=False) == []
    [problem] = inference_problems(config, cpu_build=True)
    assert problem.startswith("'return_routes' = true asks the server for each token's routed experts")
    monkeypatch.setattr("prime_rl.engine.server.is_cpu_build", lambda: True)
    with pytest.raises(ConfigError, match=r"'orchestrator\.return_routes' = true asks the server .* set orchestrator\.return_routes = false"):  # fmt: skip
        check_rl(RLConfig(model=str(tiny_moe_model)))
    check_rl(RLConfig(model=str(tiny_moe_model), orchestrator={"return_routes": False}))
