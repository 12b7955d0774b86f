"""Reward models: Bradley-Terry training on the trainer's step (checkpoints and resume, data and
context parallelism, the saved classifier scoring as the trained model did), batched scoring
in-process and over HTTP, scores that land in the rollouts' rewards, and failures that fail the
rollout instead of training on a made-up score."""

import asyncio
import copy
import json
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from config_test import parse_error
from orchestrator_test import make_config, rollouts, run
from safetensors.torch import load_file
from trainer_grad_test import ranks_cmd
from transformers import AutoModel, AutoTokenizer

from fake_server import FakeServer
from prime_rl.inference.reward_server import RewardServerConfig, make_server
from prime_rl.model.reward import init_reward_model, load_reward_model
from prime_rl.orchestrator.envs.reward_model import Batcher, RemoteScorer, reward_function
from prime_rl.orchestrator.envs.rewards import RewardRunner
from prime_rl.orchestrator.envs.scoring import Hook, RewardError, Scorer
from prime_rl.orchestrator.envs_config import RewardsConfig
from prime_rl.orchestrator.rewards.reward_model import RewardModelReward
from prime_rl.runtime.monitor import read_metrics
from prime_rl.trainer.batch import PackedBatch
from prime_rl.trainer.head import ScalarHead
from prime_rl.trainer.model import ModelLoadError
from prime_rl.trainer.parallel.dist import World
from prime_rl.trainer.reward_model.data import pack_pairs, split_pairs
from prime_rl.trainer.reward_model.main import RewardModelTrainConfig, train
from prime_rl.trainer.reward_model.objective import BradleyTerry, check_classifier
from prime_rl.trainer.step import accumulate

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


WORDS = ["cat", "dog", "sun", "sky", "tree", "bird", "fish", "rain", "snow", "wind"]


def write_pairs(path: Path, repeat: int) -> Path:
    """Chosen replies carry the tags, rejected ones do not: a preference a tiny model learns in a few
    steps. Prompts and replies vary in length, so pairs pack unevenly."""
    lines = [
        json.dumps({"prompt": w * (i % 3 + 1), "chosen": f"<answer>{w[::-1]}</answer>", "rejected": w[::-1] * (i % 2 + 1)})
        for i, w in enumerate(WORDS * repeat)
    ]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


SMALL = {"max_steps": 6, "batch_size": 7, "seq_len": 256, "max_length": 64, "eval_interval": 3,
         "scheduler": {"type": "linear", "warmup_steps": 2}}  # fmt: skip
"""A short run on 30 training pairs (10 held out): each step's 7 pairs pack into 3 micro-batches of 2
or 3 pairs (so 2 ranks get 2 and 1 + a filler), and the 6 steps go into a second epoch."""


def small_config(tmp_path: Path, run: str, **extra) -> RewardModelTrainConfig:
    data = {"path": write_pairs(tmp_path / "pairs.jsonl", 4), "eval_fraction": 0.25}
    return RewardModelTrainConfig(
        model={"name": BASE}, output_dir=tmp_path / run, data=data, **{**SMALL, **extra}
    )


def held_out_figures(config: RewardModelTrainConfig, folder: Path) -> tuple[float, float]:
    """(accuracy, mean margin) of the saved folder on the held-out pairs, scored as the orchestrator
    scores (padded batches of `RewardModel.forward`)."""
    rm = load_reward_model(str(folder))
    _, held_out = split_pairs(config.data, rm.tokenizer, config.max_length, config.seed)
    with torch.inference_mode():
        scores = rm.forward([p.chosen for p in held_out] + [p.rejected for p in held_out])
    diff = (scores[: len(held_out)] - scores[len(held_out) :]).tolist()
    return sum(d > 0 for d in diff) / len(diff), sum(diff) / len(diff)


def test_training_on_pairs_learns_the_preference_and_saves_a_loadable_model(tmp_path):
    write_pairs(tmp_path / "pairs.jsonl", 20)
    config = RewardModelTrainConfig(
        model={"name": BASE}, output=tmp_path / "rm", output_dir=tmp_path / "run", max_steps=40, batch_size=16,
        optim={"lr": 3e-3}, eval_interval=40, data={"path": tmp_path / "pairs.jsonl", "eval_fraction": 0.1},
    )  # fmt: skip
    result = train(config)
    assert result["accuracy"] >= 0.95 > result["start_accuracy"]
    assert json.loads((tmp_path / "rm" / "reward_model_eval.json").read_text()) == result
    records = read_metrics(tmp_path / "run" / "reward_model" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(40))
    assert records[-1]["eval/accuracy"] == result["accuracy"]
    rm = load_reward_model(str(tmp_path / "rm"))
    good, bad = rm.score([(PROMPT, completion("<answer>cba</answer>")), (PROMPT, completion("cba"))])
    assert good > bad
    # The saved classifier scores the held-out pairs as the trained model did, read on packed pairs.
    accuracy, margin = held_out_figures(config, tmp_path / "rm")
    assert accuracy == result["accuracy"] and margin == pytest.approx(result["margin"], rel=1e-4)


def test_a_lora_reward_model_is_saved_with_the_adapter_folded_into_its_weights(tmp_path):
    config = small_config(tmp_path, "run", lora={"rank": 4, "alpha": 8.0}, max_steps=3, optim={"lr": 1e-2})
    result = train(config)
    folder = tmp_path / "run" / "reward_model" / "model"
    state = load_file(folder / "model.safetensors")
    base = load_file(Path(BASE) / "model.safetensors")
    assert not any("lora" in k or "base_layer" in k for k in state)
    # The adapted projections moved away from the base weights; the rest is the base model's.
    moved = [k for k in state if k != "score.weight" and not torch.equal(state[k], base[k])]
    assert moved and all(k.endswith("_proj.weight") for k in moved), moved
    accuracy, margin = held_out_figures(config, folder)
    assert accuracy == result["accuracy"] and margin == pytest.approx(result["margin"], rel=1e-4)


FIGURES = (
    "loss",
    "accuracy",
    "margin",
    "grad_norm",
    "lr",
    "loss_tokens",
    "eval/loss",
    "eval/accuracy",
    "eval/margin",
)


def figures(run: Path) -> list[tuple]:
    """Each metrics record of a run's folder: its step and the figures that do not depend on timing."""
    return [
        (r["step"], *(r.get(k) for k in FIGURES))
        for r in read_metrics(run / "reward_model" / "metrics.jsonl")
    ]


class Crash(Exception):
    pass


def test_a_run_stopped_after_a_checkpoint_resumes_and_ends_as_an_uninterrupted_one(tmp_path, monkeypatch):
    whole = train(small_config(tmp_path, "whole"))
    steps, crash = [], True
    real_step = BradleyTerry.train_step

    def crash_at_step_5(self, micro_batches, step=0):
        steps.append(micro_batches[0].header.step)
        if micro_batches[0].header.step == 5 and crash:  # steps 0-4 logged, the newest checkpoint is step 4's
            raise Crash
        return real_step(self, micro_batches, step)

    monkeypatch.setattr(BradleyTerry, "train_step", crash_at_step_5)
    with pytest.raises(Crash):
        train(small_config(tmp_path, "stopped", ckpt={"interval": 2}))
    assert not (tmp_path / "stopped" / "reward_model" / "model").exists()
    steps.clear()
    crash = False
    resumed = train(small_config(tmp_path, "stopped", ckpt={"interval": 2, "resume_step": -1}))
    assert steps == [4, 5]  # from the checkpoint, not from the start
    del resumed["seconds"], whole["seconds"]
    assert resumed == whole
    a = load_file(tmp_path / "whole" / "reward_model" / "model" / "model.safetensors")
    b = load_file(tmp_path / "stopped" / "reward_model" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # One record per step, step 4's logged again after the resume and nothing twice.
    assert figures(tmp_path / "stopped") == figures(tmp_path / "whole")


def test_pairs_pack_whole_with_their_last_tokens_scored_and_the_same_count_on_every_rank(tmp_path):
    config = small_config(tmp_path, "run")
    pairs, _ = split_pairs(config.data, AutoTokenizer.from_pretrained(BASE), config.max_length, config.seed)
    ranks = pack_pairs(pairs[:7], config.seq_len, 2, "rm", 0)
    # 3 micro-batches' worth of pairs: one rank gets 2, the other 1 and a filler.
    assert len(ranks[0]) == len(ranks[1]) == 2 and sum(mb.filler for rank in ranks for mb in rank) == 1
    got = []
    for mb in (mb for rank in ranks for mb in rank if not mb.filler):
        a = mb.arrays()
        assert sum(mb.sample_lens) <= config.seq_len and len(mb.sample_lens) % 2 == 0
        ends = torch.tensor(mb.sample_lens).cumsum(0)
        assert a["loss_mask"].nonzero()[0].tolist() == (ends - 1).tolist()
        for start, n in zip((ends - torch.tensor(mb.sample_lens)).tolist(), mb.sample_lens, strict=True):
            assert a["position_ids"][start : start + n].tolist() == list(range(n))
        ids = a["input_ids"].tolist()
        samples = [ids[e - n : e] for e, n in zip(ends.tolist(), mb.sample_lens, strict=True)]
        got += [(samples[i], samples[i + 1]) for i in range(0, len(samples), 2)]
    assert sorted(got) == sorted((p.chosen, p.rejected) for p in pairs[:7])


def test_a_step_follows_the_gradient_of_the_mean_pair_loss_over_the_batch(tmp_path):
    """Packed into 3 micro-batches, the step's gradient is that of the mean of -log sigmoid(s_chosen -
    s_rejected) over the batch's pairs, each sample scored alone at its last token."""
    config = small_config(tmp_path, "run")
    world = World()
    rm = BradleyTerry(config, world)
    reference = copy.deepcopy(rm.model)
    train_pairs, _ = split_pairs(
        config.data, AutoTokenizer.from_pretrained(BASE), config.max_length, config.seed
    )
    pairs = train_pairs[:7]
    mbs = pack_pairs(pairs, config.seq_len, 1, "rm", 0)[0]
    assert len(mbs) == 3
    acc = accumulate(rm, [PackedBatch.of(mb, world) for mb in mbs], rm.parts, world)

    def score(ids: list[int]) -> torch.Tensor:
        return reference(torch.tensor(ids), torch.arange(len(ids)))[-1]

    diff = torch.stack([score(p.chosen) - score(p.rejected) for p in pairs])
    loss = -torch.nn.functional.logsigmoid(diff).mean()
    loss.backward()
    assert acc.totals.samples == 14 and acc.metrics["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert acc.metrics["accuracy"] == pytest.approx(float((diff > 0).float().mean()))
    assert acc.metrics["margin"] == pytest.approx(diff.mean().item(), rel=1e-4)
    for (name, p), q in zip(rm.model.named_parameters(), reference.parameters(), strict=True):
        assert q.grad.abs().max() > 0, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=f"gradient of {name} differs")


def test_a_body_that_would_not_save_as_its_classifier_is_refused_before_training(tmp_path):
    config = small_config(tmp_path, "run")
    body = AutoModel.from_pretrained(BASE)
    check_classifier(
        ScalarHead(body, 128, bias=False, seed=0, std=0.02), config
    )  # the tiny model's hidden size
    with pytest.raises(
        ModelLoadError, match=r"Qwen3ForSequenceClassification's .*other shapes: \['score.weight'\]"
    ):
        check_classifier(ScalarHead(body, 64, bias=False, seed=0, std=0.02), config)


def as_flags(settings: dict, prefix: str = "") -> list[str]:
    """Config settings as command-line flags (`--scheduler.type linear ...`)."""
    out = []
    for key, value in settings.items():
        if isinstance(value, dict):
            out += as_flags(value, f"{prefix}{key}.")
        else:
            out += [f"--{prefix}{key}", str(value)]
    return out


def run_ranks(tmp_path: Path, config: RewardModelTrainConfig, run: str, *flags: str) -> list[tuple]:
    """`train-reward-model` on 2 torchrun ranks (gloo, FSDP2) with the small config and `flags`; its
    figures."""
    settings = {**SMALL, "model": {"name": BASE}, "output_dir": tmp_path / run,
                "data": {"path": config.data.path, "eval_fraction": config.data.eval_fraction}}  # fmt: skip
    cmd = ranks_cmd(2, "-m", "prime_rl.trainer.reward_model.main", *as_flags(settings), *flags)
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        f"train-reward-model: wrote {tmp_path / run / 'reward_model' / 'model'}; held-out accuracy"
        in proc.stdout
    )
    return figures(tmp_path / run)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> tuple[Path, RewardModelTrainConfig, list[tuple]]:
    """(the saved folder, the config, the figures) of the small run on one rank."""
    tmp = tmp_path_factory.mktemp("rm-one")
    config = small_config(tmp, "one")
    train(config)
    return tmp / "one" / "reward_model" / "model", config, figures(tmp / "one")


@pytest.mark.parametrize("flags", [(), ("--parallel.cp", "2")], ids=["dp=2", "cp=2"])
def test_two_ranks_train_the_same_model_as_one(tmp_path, one_rank, flags):
    folder, config, one = one_rank
    two = run_ranks(tmp_path, config, "two", *flags)
    assert [r[0] for r in two] == [r[0] for r in one]
    for a, b in zip(one, two, strict=True):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-6), (a, b)
    first = load_file(Path(BASE) / "model.safetensors")
    a = load_file(folder / "model.safetensors")
    b = load_file(tmp_path / "two" / "reward_model" / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    # The body trained far beyond the tolerance below (the same names as in the causal LM).
    assert max((a[k] - first[k]).abs().max() for k in a if k != "score.weight") > 1e-3
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-4, msg=f"{k} differs")


def test_old_keys_name_their_new_place_and_a_pair_must_fit_a_micro_batch(tmp_path, capsys):
    old = tmp_path / "old.toml"
    old.write_text(
        f'base_model = "{BASE}"\nlr = 1e-3\nweight_decay = 0.1\noutput = "rm"\n[data]\npath = "p.jsonl"\n'
    )
    err = parse_error(RewardModelTrainConfig, ["@", str(old)], capsys)
    for key, new in (
        ("base_model", "model.name"),
        ("lr", "optim.lr"),
        ("weight_decay", "optim.weight_decay"),
    ):
        assert f"'{key}' (from {old}) is gone" in err and f"'{new}'" in err
    err = parse_error(
        RewardModelTrainConfig, ["--model.name", BASE, "--data.path", "p.jsonl", "--seq_len", "1000"], capsys
    )
    assert "seq_len = 1000 must hold a whole pair" in err and "seq_len >= 1024" in err


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
    hook = Hook(reward_function(Batcher(scorer.score_batch, 8, 0.001)), "reward_model", "reward")

    async def go():
        try:
            await Scorer(runner)._call(hook, {"prompt": PROMPT, "completion": completion("cba")})
        finally:
            await scorer.aclose()

    with pytest.raises(RewardError, match="reward function 'reward_model' raised RewardModelError") as e:
        asyncio.run(go())
    server.shutdown()
    runner.close()
    assert FailingServer.posts == 2  # the request and one retry
    assert "failed 2 time(s), last: HTTP 503" in str(e.value)


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
