"""Reward models: Bradley-Terry training, batched scoring in-process and over HTTP, scores that land
in the rollouts' rewards, and failures that fail the rollout instead of training on a made-up score."""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from orchestrator_test import make_config, rollouts, run

from fake_server import FakeServer
from prime_rl.inference.reward_server import RewardServerConfig, make_server
from prime_rl.model.reward import RewardModelError, init_reward_model, load_reward_model
from prime_rl.orchestrator.envs.reward_model import Batcher, RemoteScorer, reward_function
from prime_rl.orchestrator.envs.rewards import REWARD_ERROR, RewardRunner
from prime_rl.orchestrator.envs_config import RewardsConfig
from prime_rl.orchestrator.rewards.reward_model import RewardModelReward
from prime_rl.trainer.reward_model.main import RewardModelTrainConfig, train

BASE = str(Path(__file__).parents[2] / "models" / "reverse_text-tiny")
PROMPT = [{"role": "user", "content": "abc"}]


def completion(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> str:
    """An untrained reward model (random head) on the reverse-text tiny model: scores differ by text."""
    out = tmp_path_factory.mktemp("rm")
    rm = init_reward_model(BASE)
    rm.model.save_pretrained(out)
    rm.tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture
def reward_server(reward_model_dir):
    server = make_server(
        RewardServerConfig(path=reward_model_dir, port=0), load_reward_model(reward_model_dir)
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_training_on_pairs_learns_the_preference_and_saves_a_loadable_model(tmp_path):
    # Chosen replies carry the tags, rejected ones do not: a preference a tiny model learns in a few steps.
    words = ["cat", "dog", "sun", "sky", "tree", "bird", "fish", "rain", "snow", "wind"]
    lines = [
        json.dumps({"prompt": w, "chosen": f"<answer>{w[::-1]}</answer>", "rejected": w[::-1]})
        for w in words * 20
    ]
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    config = RewardModelTrainConfig(
        base_model=BASE, output=tmp_path / "rm", max_steps=40, batch_size=16, lr=3e-3, eval_interval=40,
        data={"path": tmp_path / "pairs.jsonl", "eval_fraction": 0.1},
    )  # fmt: skip
    result = train(config)
    assert result["accuracy"] >= 0.95 > result["start_accuracy"]
    rm = load_reward_model(str(tmp_path / "rm"))
    good, bad = rm.score([(PROMPT, completion("<answer>cba</answer>")), (PROMPT, completion("cba"))])
    assert good > bad


def test_batcher_scores_concurrent_calls_in_batches_and_fails_a_whole_batch_together():
    calls = []

    async def score_batch(items):
        calls.append(list(items))
        if "boom" in items:
            raise RuntimeError("model fell over")
        return [float(len(i)) for i in items]

    async def go():
        batcher = Batcher(score_batch, batch_size=4, max_wait_s=0.05)
        ok = await asyncio.gather(*(batcher.score("x" * n) for n in range(1, 11)))
        bad = await asyncio.gather(batcher.score("a"), batcher.score("boom"), return_exceptions=True)
        return ok, bad

    ok, bad = asyncio.run(go())
    assert ok == [float(n) for n in range(1, 11)]
    assert [len(c) for c in calls] == [4, 4, 2, 2]  # two full batches, the rest after max_wait
    assert all(isinstance(e, RuntimeError) for e in bad)


def test_remote_scores_equal_local_ones(reward_model_dir, reward_server):
    local = load_reward_model(reward_model_dir)
    convs = [(PROMPT, completion(t)) for t in ("cba", "abc", "<answer>cba</answer>", "")]
    scorer = RemoteScorer(RewardModelReward(type="reward_model", url=reward_server), "envs[0].rewards[0]")

    async def go():
        await scorer.check()
        try:
            return await scorer.score_batch(convs)
        finally:
            await scorer.aclose()

    assert asyncio.run(go()) == pytest.approx(local.score(convs), abs=1e-5)


class FailingServer(BaseHTTPRequestHandler):
    posts = 0

    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):
        type(self).posts += 1
        self.send_response(503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_failing_reward_server_fails_the_rollout_with_the_reason_after_its_retries():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FailingServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = RewardModelReward(
        type="reward_model", url=f"http://127.0.0.1:{server.server_address[1]}", retries=1
    )
    runner = RewardRunner(RewardsConfig())
    scorer = RemoteScorer(config, "envs[0].rewards[0]")
    func = runner.wrap(reward_function(Batcher(scorer.score_batch, 8, 0.001)), group=False)
    state = {}

    async def go():
        try:
            await func(prompt=PROMPT, completion=completion("cba"), state=state)
        finally:
            await scorer.aclose()

    with pytest.raises(RewardModelError):
        asyncio.run(go())
    server.shutdown()
    runner.close()
    assert FailingServer.posts == 2  # the request and one retry
    assert "failed 2 time(s), last: HTTP 503" in state[REWARD_ERROR]


@pytest.mark.parametrize("env_workers", [0, 1], ids=["in-process", "env-workers"])
def test_orchestrator_trains_on_the_reward_models_score_and_keeps_the_envs_as_metrics(
    tmp_path, reward_model_dir, env_workers
):
    rm = {"type": "reward_model", "path": reward_model_dir, "weight": 2.0, "env_reward_weight": 0.0}
    with FakeServer() as server:
        config = make_config(tmp_path, server, env_workers=env_workers, max_steps=1, envs=[
            {"id": "reverse-text", "group_size": 4, "sampling": {"max_tokens": 16}, "rewards": [rm]}
        ])  # fmt: skip
        metrics = run(config)
    local = load_reward_model(reward_model_dir)
    recs = rollouts(config, 0)
    assert len(recs) >= 8
    for r in recs:
        # The fake server reverses the text exactly, so the env's own reward is 1.0; it no longer
        # counts, but stays reported. The reward is 2x the model's score of this very conversation.
        expected = local.score([(r["prompt"], r["completion"])])[0]
        assert r["metrics"]["reward_model"] == pytest.approx(expected, abs=1e-4)
        assert r["reward"] == pytest.approx(2 * expected, abs=1e-4)
    assert metrics[0]["metric/reversal_reward/reverse-text"] == 1.0
