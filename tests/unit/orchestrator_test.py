"""The orchestrator end to end in one process, against a fake inference server that fails, delays or
truncates chosen requests, with real verifiers envs and the filesystem transport."""

import asyncio
import json
import logging
import math
from pathlib import Path

import pytest

from fake_server import MODEL, FakeServer, Reply, tokenizer, user_text
from prime_rl.environments import EnvError
from prime_rl.orchestrator.advantages import AdvantageError
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.main import make_orchestrator
from prime_rl.runtime.monitor import read_metrics
from prime_rl.transport.file_transport import FileReceiver
from prime_rl.transport.messages import MicroBatch


def make_config(tmp_path: Path, server: FakeServer, **overrides) -> OrchestratorConfig:
    base = {
        "output_dir": str(tmp_path / "run"),
        "model": {"name": MODEL},
        "max_steps": 3,
        "batch_size": 8,
        "max_async_level": 10,  # no trainer publishes weights here: never wait for them
        "seq_len": 256,
        "envs": [{"id": "reverse-text", "group_size": 4, "sampling": {"max_tokens": 16}}],
        "client": {"base_urls": [server.base_url], "timeout_s": 10, "health_timeout_s": 10},
        "transport": {"type": "filesystem", "run_id": "test"},
        "filters": [],
    }
    return OrchestratorConfig(**{**base, **overrides})


@pytest.fixture(params=[0, 1], ids=["in-process", "env-workers"])
def env_workers(request) -> int:
    """Tests that take it run twice: envs in this process, and in one env worker process."""
    return request.param


def run(config: OrchestratorConfig) -> list[dict]:
    asyncio.run(make_orchestrator(config).run())
    return read_metrics(Path(config.output_dir) / "orchestrator" / "metrics.jsonl")


def rollouts(config: OrchestratorConfig, step: int) -> list[dict]:
    path = Path(config.output_dir) / "rollouts" / f"step_{step:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_accounting(metrics: list[dict]) -> None:
    for m in metrics:
        buckets = sum(m[f"rollouts/all/{b}_total"] for b in ("trained", "filtered", "failed", "stale"))
        pending = m["rollouts/all/inflight"] + m["rollouts/all/waiting"]
        assert m["rollouts/all/dispatched_total"] == buckets + pending, m


def received(config: OrchestratorConfig, steps: int, rank: int = 0) -> list[MicroBatch]:
    receiver = FileReceiver(Path(config.output_dir) / "transport", "test", rank=rank, timeout_s=1)
    out = []
    while True:
        mb = receiver.recv()
        out.append(mb)
        if mb.header.step == steps - 1 and mb.index == mb.count - 1:
            return out


def test_steps_stream_micro_batches_and_log(tmp_path, env_workers):
    with FakeServer() as server:
        config = make_config(tmp_path, server, env_workers=env_workers, envs=[
            {"id": "reverse-text", "group_size": 4, "sampling": {"max_tokens": 16}, "state_columns": ["answer"]}
        ])  # fmt: skip
        metrics = run(config)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all(m["reward/all/mean"] == 1.0 for m in metrics)  # the fake server answers correctly
    assert_accounting(metrics)
    mbs = received(config, 3)
    assert {mb.header.step for mb in mbs} == {0, 1, 2}
    for mb in mbs:
        mb.validate(seq_len=256)
    # Rollouts log: one line per rollout with the env's state column.
    recs = rollouts(config, 0)
    assert len(recs) >= 8 and all(r["answer"] == r["prompt"][-1]["content"][::-1] for r in recs)
    # Every request asked for what training needs: token ids in (the prompt), ids and logprobs out.
    req = server.requests[0]
    assert (
        all(isinstance(t, int) for t in req["prompt"])
        and req["logprobs"] == 0
        and req["return_token_ids"] is True
        and req["max_tokens"] == 16
    )


def test_partial_groups_train_on_survivors(tmp_path, env_workers):
    def script(req, i):
        # For every example, the 1st and 3rd request fail: each group of 4 loses 2.
        return Reply(status=500) if i % 4 in (0, 2) else Reply(text="wrong" if i % 8 == 1 else None)

    with FakeServer(script) as server:
        # One request per rollout, so that the failures hit single rollouts (a merged request
        # fails or succeeds for the whole group).
        config = make_config(tmp_path, server, env_workers=env_workers, max_inflight_rollouts=4, max_steps=2, client={
            "base_urls": [server.base_url], "timeout_s": 10, "health_timeout_s": 10, "group_requests": False,
        })  # fmt: skip
        metrics = run(config)
    assert_accounting(metrics)
    assert sum(m["rollouts/all/failed"] for m in metrics) > 0
    recs = rollouts(config, 0)
    trained = [r for r in recs if r["trained"]]
    failed = [r for r in recs if r["trained"] is None]
    assert trained and failed and all(r["error"] for r in failed)
    by_example: dict = {}
    for r in trained:
        by_example.setdefault(r["example_id"], []).append(r)
    assert all(len(g) == 2 for g in by_example.values())  # partial groups of the 2 survivors
    for g in by_example.values():  # advantages are computed over the survivors only
        assert math.isclose(sum(r["advantage"] for r in g), 0.0, abs_tol=1e-9)


def test_group_scoring_drops_the_whole_group_on_any_failure(tmp_path, env_workers):
    def script(req, i):
        return Reply(status=500) if int(user_text(req).split()[1]) % 3 == 0 else Reply()

    with FakeServer(script) as server:
        config = make_config(
            tmp_path,
            server,
            env_workers=env_workers,
            max_steps=4,
            envs=[{"id": "group-scored-env", "group_size": 3}],
        )
        metrics = run(config)
    assert_accounting(metrics)
    trained = [r for s in range(4) for r in rollouts(config, s) if r["trained"]]
    assert trained and not any(int(r["prompt"][-1]["content"].split()[1]) % 3 == 0 for r in trained)
    failures = sum(m["rollouts/all/failed"] for m in metrics)
    assert (
        failures % 3 == 0 and failures > 0
    )  # whole groups: a successful rollout of such a group is dropped too


def test_all_failed_and_truncated_responses_are_dropped_not_crashing(tmp_path):
    def script(req, i):
        text = user_text(req)
        if text[0] <= "h":
            return Reply(status=503)
        if text[0] <= "p":
            return Reply(truncate=True)  # no token ids: untrainable
        return Reply()

    with FakeServer(script) as server:
        config = make_config(tmp_path, server, max_steps=2)
        metrics = run(config)
    assert_accounting(metrics)
    recs = [r for s in range(2) for r in rollouts(config, s)]
    trained = [r for r in recs if r["trained"]]
    assert trained and not any(r["prompt"][-1]["content"][0] <= "p" for r in trained)
    errors = [r["error"] for r in recs if r["trained"] is None]
    assert any("token ids" in e for e in errors) and any("503" in e or "Error" in e for e in errors)


def test_min_group_size_and_zero_advantage_filter(tmp_path):
    def script(req, i):
        return Reply(status=500) if i % 4 == 0 else Reply()

    with FakeServer(script) as server:
        config = make_config(
            tmp_path, server, max_steps=2, min_group_size=4, max_inflight_rollouts=4,
            filters=[{"type": "zero_advantage"}],
        )  # fmt: skip
        metrics = run(config)
    assert_accounting(metrics)
    # Groups of 3 survivors fall below min_group_size 4 and are filtered; full groups all answer
    # correctly (reward 1.0, advantage 0) and are filtered by zero_advantage: nothing trains.
    assert sum(m["rollouts/all/trained"] for m in metrics) == 0
    assert sum(m["rollouts/all/filtered"] for m in metrics) >= 16
    mbs = received(config, 2)
    assert all(not any(mb.arrays()["loss_mask"]) for mb in mbs)


def test_monitor_only_filter_counts_but_trains(tmp_path):
    with FakeServer() as server:
        config = make_config(
            tmp_path, server, max_steps=1, filters=[{"type": "zero_advantage", "monitor_only": True}]
        )
        metrics = run(config)
    assert metrics[0]["rollouts/all/trained"] >= 8 and metrics[0]["rollouts/all/filtered"] == 0
    assert metrics[0]["filter/zero_advantage/reverse-text"] >= 8
    # The env's own metric functions are logged per env; here the only one is the reward itself.
    assert metrics[0]["metric/reversal_reward/reverse-text"] == pytest.approx(
        metrics[0]["reward/reverse-text/mean"]
    )
    m = metrics[0]
    parts = m["time/generate"] + m["time/wait_trainer"] + m["time/reload"]
    assert m["time/generate"] > 0 and parts == pytest.approx(m["time/collect"], abs=1e-6)


def test_custom_advantage_plugin_is_called_with_kwargs(tmp_path, env_workers):
    def script(req, i):
        return Reply(text=user_text(req)[::-1][: 1 + i % 4])  # prefixes of the answer: distinct rewards

    with FakeServer(script) as server:
        config = make_config(
            tmp_path, server, env_workers=env_workers, max_steps=1, max_inflight_rollouts=4,
            advantage={"type": "custom_advantages:scaled_rank", "kwargs": {"scale": 2.0}},
        )  # fmt: skip
        run(config)
    recs = rollouts(config, 0)
    by_example: dict = {}
    for r in recs:
        by_example.setdefault(r["example_id"], []).append(r)
    for group in by_example.values():
        ranked = sorted(group, key=lambda r: r["reward"])
        advs = [r["advantage"] for r in ranked]
        if len({r["reward"] for r in group}) == len(group):
            assert advs == [-3.0, -1.0, 1.0, 3.0]


@pytest.mark.parametrize(
    ("import_path", "message"),
    [
        ("custom_advantages:missing", "has no function 'missing'"),
        ("no_such_module:fn", "cannot import 'no_such_module'"),
        ("custom_advantages:wrong_length", "returned 1 advantages for a group of 4"),
        ("custom_advantages:not_finite", "non-finite"),
    ],
)
def test_bad_custom_advantage_is_a_clear_error(tmp_path, import_path, message):
    with FakeServer() as server:
        config = make_config(tmp_path, server, max_steps=1, advantage={"type": import_path})
        with pytest.raises(AdvantageError, match=message) as exc:
            run(config)
    assert "custom_advantages" in str(exc.value) or "no_such_module" in str(exc.value)
    if "returned" in message or "non-finite" in message:
        assert "env 'reverse-text'" in str(exc.value) and "example" in str(exc.value)


def test_bad_env_id_and_bad_dataset_are_clear_errors(tmp_path):
    with FakeServer() as server:
        with pytest.raises(EnvError, match="env 'no-such-env' could not be loaded"):
            run(make_config(tmp_path, server, envs=[{"id": "no-such-env"}]))
        with pytest.raises(EnvError, match="empty-env"):
            run(make_config(tmp_path, server, envs=[{"id": "empty-env"}]))


def test_unreachable_inference_is_a_clear_error_after_backoff(tmp_path):
    from prime_rl.orchestrator.loop.servers import InferenceUnavailable

    config = OrchestratorConfig(
        output_dir=str(tmp_path),
        model={"name": MODEL},
        client={"base_urls": ["http://127.0.0.1:9/v1"], "health_timeout_s": 1.5},
    )
    with pytest.raises(InferenceUnavailable, match=r"127.0.0.1:9 was not healthy after 2 s"):
        run(config)


def test_eval_runs_beside_training_with_its_own_sampling(tmp_path, env_workers):
    with FakeServer() as server:
        config = make_config(
            tmp_path, server, env_workers=env_workers, max_steps=2,
            eval={"interval": 1, "at_start": True, "envs": [{"id": "reverse-text", "name": "rt-eval", "num_examples": 5}]},
        )  # fmt: skip
        metrics = run(config)
    evals = [m for m in metrics if "eval/rt-eval/reward/mean" in m]
    assert [m["step"] for m in evals] == [0, 1, 2]
    assert all(m["eval/rt-eval/rollouts"] == 5 and m["eval/rt-eval/reward/mean"] == 1.0 for m in evals)
    eval_requests = [r for r in server.requests if r.get("temperature") == 0.0]
    assert len(eval_requests) == 15  # greedy by default, 5 examples x 3 evaluations


def test_zero_advantage_filter_sees_through_float_noise(tmp_path):
    # Every answer is equally (partly) right: rewards are equal but not 0 or 1, so the group mean
    # leaves ~1e-17 residues that must still count as zero advantage.
    with FakeServer(lambda req, i: Reply(text=user_text(req)[::-1][:2])) as server:
        config = make_config(tmp_path, server, max_steps=1, filters=[{"type": "zero_advantage"}])
        metrics = run(config)
    assert metrics[0]["rollouts/all/trained"] == 0 and metrics[0]["rollouts/all/filtered"] >= 8


def test_a_multi_turn_env_trains_merged_samples_and_logs_its_turns(tmp_path, env_workers):
    # The fake server reverses the user's text, never an `<answer>`: every game takes all 3 turns.
    with FakeServer() as server:
        config = make_config(
            tmp_path,
            server,
            env_workers=env_workers,
            max_steps=2,
            seq_len=512,
            envs=[{"id": "digit-sum-feedback", "group_size": 4}],
        )
        metrics = run(config)
        mbs = received(config, steps=2)
    env = "digit-sum-feedback"
    for m in metrics:
        assert m[f"turns/{env}/mean"] == 3.0 and m[f"samples_per_rollout/{env}"] == 1.0
        assert m[f"tokens/{env}/env"] > 0 and m[f"tokens/{env}/model"] > 0
        assert m[f"tool_calls/{env}"] == 0.0 and m[f"truncated_multi_turn/{env}"] == 0.0  # no length cut
    rows = rollouts(config, 0)
    assert all(
        [m["role"] for m in r["completion"]] == ["assistant", "user"] * 2 + ["assistant"] for r in rows
    )
    assert all(len(r["turns"]) == 3 and {t["sample"] for t in r["turns"]} == {0} for r in rows)
    # One sample per trained rollout, holding the env's two replies with loss mask 0 and the
    # model's three answers with mask 1.
    hint = "Reply as <answer>N</answer>."
    samples = 0
    for mb in mbs:
        a, start = mb.arrays(), 0
        for n in mb.sample_lens:
            ids, mask = a["input_ids"][start : start + n], a["loss_mask"][start : start + n]
            start += n
            if not mask.any():
                continue  # filler
            samples += 1
            env_text = tokenizer().decode([int(t) for t, m in zip(ids, mask, strict=True) if not m])
            model_text = tokenizer().decode([int(t) for t, m in zip(ids, mask, strict=True) if m])
            # the system prompt says it once, the env twice
            assert env_text.count(hint) == 3 and hint not in model_text
    assert samples == sum(m["rollouts/all/trained"] for m in metrics) > 0


def uniform_or_mixed(req, i):
    """Half the examples (by prompt) answered right by every rollout: a uniform group; the others
    right by every other request, wrong otherwise: a mixed group."""
    if sum(map(ord, user_text(req))) % 2:
        return Reply()
    return Reply() if i % 2 else Reply(text="zz")


def test_dynamic_sampling_replaces_uniform_groups_so_every_step_is_full(tmp_path, env_workers):
    with FakeServer(uniform_or_mixed) as server:
        client = {"base_urls": [server.base_url], "timeout_s": 10, "group_requests": False}
        config = make_config(
            tmp_path, server, env_workers=env_workers, max_steps=3, client=client, dynamic_sampling={"enabled": True},
            filters=[{"type": "zero_advantage"}],
        )  # fmt: skip
        metrics = run(config)
    assert_accounting(metrics)
    assert [m["rollouts/all/trained"] for m in metrics] == [8, 8, 8]  # exactly batch_size, every step
    assert sum(m["dynamic_sampling/dropped/all"] for m in metrics) >= 4  # uniform groups were replaced
    assert all(m["dynamic_sampling/short"] == 0.0 for m in metrics)
    for step, m in enumerate(metrics):
        records = rollouts(config, step)
        dropped = [r for r in records if r["trained"] is False and r["advantage"] is None]
        assert len(dropped) == m["dynamic_sampling/dropped/all"]  # dropped rollouts are logged
        assert all(len({r["reward"] for r in dropped if r["example_id"] == e}) == 1
                   for e in {r["example_id"] for r in dropped})  # fmt: skip


def test_dynamic_sampling_stops_backfilling_at_max_backfill_and_says_so(tmp_path, caplog):
    with FakeServer() as server:  # every answer right: every group uniform
        config = make_config(
            tmp_path, server, max_steps=2, dynamic_sampling={"enabled": True, "max_backfill": 3},
            max_inflight_rollouts=8,
        )  # fmt: skip
        with caplog.at_level(logging.WARNING):
            metrics = run(config)
    assert_accounting(metrics)
    assert [m["rollouts/all/trained"] for m in metrics] == [0, 0]
    assert all(
        m["dynamic_sampling/short"] == 1.0 and m["dynamic_sampling/dropped/all"] >= 16 for m in metrics
    )
    assert "dynamic sampling dropped" in caplog.text and "max_backfill = 3" in caplog.text
    assert len(received(config, 2)) >= 2  # the trainer still gets every step (filler micro-batches)


def test_difficulty_filter_skips_always_solved_examples_and_resumes_with_its_memory(tmp_path):
    """reverse-text with 6 examples, group size 4, batch 8, one group in flight at a time. Half the
    examples are always answered right (pass rate 1: skipped once seen), the others right every
    other time: from the second epoch on, only those are drawn."""
    with FakeServer(uniform_or_mixed) as server:
        client = {"base_urls": [server.base_url], "timeout_s": 10, "group_requests": False}
        envs = [
            {
                "id": "reverse-text",
                "args": {"num_examples": 6},
                "group_size": 4,
                "sampling": {"max_tokens": 16},
            }
        ]
        config = make_config(
            tmp_path, server, max_steps=6, client=client, envs=envs, max_inflight_rollouts=4,
            difficulty_filter={"enabled": True, "pass_threshold": 1.0},
        )  # fmt: skip
        metrics = run(config)
        solved = {r["example_id"] for s in range(6) for r in rollouts(config, s) if r["reward"] == 1.0}
        easy = {e for e in solved if all(r["reward"] == 1.0 for s in range(6) for r in rollouts(config, s)
                                         if r["example_id"] == e)}  # fmt: skip
        assert easy and sum(m["difficulty/skipped/reverse-text"] for m in metrics) > 0
        seen = [[r["example_id"] for r in rollouts(config, s)] for s in range(6)]
        for e in easy:  # an easy example trains once, then is skipped
            assert sum(e in ids for ids in seen) == 1, (e, seen)
        progress = json.loads((Path(config.output_dir) / "orchestrator" / "progress.json").read_text())
        assert set(progress["difficulty"]["reverse-text"]) == {str(e) for e in easy}
        more = run(config.model_copy(update={"max_steps": 8}))  # resumed: the memory still skips them
        later = [r["example_id"] for s in (6, 7) for r in rollouts(config, s)]
        assert not easy & set(later) and later
    assert more[-1]["difficulty/remembered/reverse-text"] >= len(easy)


def test_a_v1_env_trains_through_the_orchestrator(tmp_path, env_workers):
    """A verifiers v1 env (its own harness and interception server) in process and in env workers:
    its rollouts, rewards and state columns reach the batches and the rollouts log."""
    with FakeServer() as server:
        config = make_config(tmp_path, server, env_workers=env_workers, envs=[
            {"id": "v1_test_env", "group_size": 4, "sampling": {"max_tokens": 16}, "state_columns": ["word"]}
        ])  # fmt: skip
        metrics = run(config)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all(m["reward/all/mean"] == 1.0 and m["rollouts/all/failed"] == 0 for m in metrics)
    assert_accounting(metrics)
    recs = rollouts(config, 0)
    assert len(recs) >= 8 and all(r["word"] == r["completion"][-1]["content"][::-1] for r in recs)
    assert len(received(config, 3)) >= 3


def test_an_endless_taskset_trains_and_evaluates_read_as_a_stream(tmp_path, env_workers):
    """A taskset that never ends cannot be listed: training draws it through the shuffle buffer, and
    an evaluation reads its first `num_examples` tasks; every task travels with its group (the env
    workers rebuild it from its data)."""
    words = {"id": "v1_test_env", "args": {"endless": True}}
    train = {
        **words,
        "group_size": 4,
        "sampling": {"max_tokens": 16},
        "shuffle_buffer": 8,
        "state_columns": ["word"],
    }
    with FakeServer() as server:
        config = make_config(
            tmp_path, server, env_workers=env_workers, envs=[train],
            eval={"interval": 2, "at_start": True, "envs": [{**words, "name": "eval", "num_examples": 3}]},
        )  # fmt: skip
        metrics = run(config)
    steps = [m for m in metrics if "rollouts/all/dispatched_total" in m]
    assert [m["step"] for m in steps] == [0, 1, 2]
    recs = [r for s in range(3) for r in rollouts(config, s)]
    assert recs and all(r["reward"] == 1.0 and r["word"] == f"word{r['example_id']}" for r in recs)
    dispatched = steps[-1]["rollouts/all/dispatched_total"] // 4
    assert max(r["example_id"] for r in recs) < dispatched + 8  # never further than the buffer
    evals = [m for m in metrics if "eval/eval/rollouts" in m]
    assert evals and all(m["eval/eval/rollouts"] == 3 and m["eval/eval/reward/mean"] == 1.0 for m in evals)
