"""The orchestrator's failure paths end to end in one process: killed and resumed around its commit
point, failing rollouts and servers, against the fake inference server of `orchestrator_test.py`."""

import logging
import math
import time
from pathlib import Path

import msgspec
import pytest
from orchestrator_test import assert_accounting, env_workers, make_config, received, rollouts, run

from fake_server import FakeServer, Reply, user_text
from prime_rl.orchestrator.loop.failures import RolloutsFailing
from prime_rl.orchestrator.loop.orchestrator import Orchestrator
from prime_rl.orchestrator.loop.sender import BatchSender
from prime_rl.runtime.monitor import read_metrics
from prime_rl.transport.messages import decode

__all__ = ["env_workers"]  # a fixture, used by name


class Killed(BaseException):
    """Stands in for SIGKILL: what is on disk when it is raised is what a restart finds."""


def test_resume_continues_at_the_next_step_and_resends_the_last_batch(tmp_path):
    with FakeServer() as server:
        first = make_config(tmp_path, server, max_steps=2)
        run(first)
        before = (
            Path(first.output_dir) / "transport" / "step_000001" / "rank_0" / "0000.msgpack"
        ).read_bytes()
        second = make_config(tmp_path, server, max_steps=4)
        metrics = run(second)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]  # appended: no step repeated or skipped
    assert_accounting(metrics)
    after = (Path(first.output_dir) / "transport" / "step_000001" / "rank_0" / "0000.msgpack").read_bytes()
    # The re-sent batch of step 1 is the saved one, not a new one, under the new orchestrator's contract.
    old, new = decode(before), decode(after)
    assert msgspec.structs.replace(old, orchestrator=None) == msgspec.structs.replace(new, orchestrator=None)
    assert old.orchestrator.session != new.orchestrator.session
    assert {mb.header.step for mb in received(second, 4)} == {0, 1, 2, 3}


def test_a_trainer_done_at_its_last_checkpoint_is_sent_nothing_again(tmp_path):
    """The trainer was killed after its checkpoint at max_steps, before the run saw it finish: when
    the run restarts, the trainer resumes with nothing to train and reads nothing, so the
    orchestrator re-sends nothing (a re-sent batch would wait for a reader forever)."""
    from prime_rl.runtime.layout import DONE, checkpoint_root

    with FakeServer() as server:
        config = make_config(tmp_path, server, max_steps=2)
        run(config)
        transport = Path(config.output_dir) / "transport"
        sent = sorted(transport.rglob("*.msgpack"))
        for f in sent:
            f.unlink()
        last = checkpoint_root(Path(config.output_dir)) / "step_2"
        last.mkdir(parents=True)
        (last / DONE).touch()
        run(config.model_copy(update={"resume": True}))
        assert sent and not list(transport.rglob("*.msgpack"))
        (last / DONE).unlink()  # a checkpoint before max_steps: the batches after it are re-sent
        (checkpoint_root(Path(config.output_dir)) / "step_1").mkdir()
        (checkpoint_root(Path(config.output_dir)) / "step_1" / DONE).touch()
        run(config.model_copy(update={"resume": True}))
        assert 1 in {mb.header.step for mb in received(config, 2)}


@pytest.mark.parametrize("where", ["_save", "send"])
def test_a_step_killed_either_side_of_its_commit_is_logged_once(tmp_path, monkeypatch, where):
    # "_save": killed after step 1's records were written but before it was committed, so it is
    # built again; "send": killed after the commit (a dead trainer blocks the send), so it is not.
    owner = Orchestrator if where == "_save" else BatchSender
    real, calls = getattr(owner, where), []

    def dies_at_step_1(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise Killed
        return real(self, *args)

    with FakeServer() as server:
        config = make_config(tmp_path, server, max_steps=3)
        monkeypatch.setattr(owner, where, dies_at_step_1)
        with pytest.raises(Killed):
            run(config)
        monkeypatch.setattr(owner, where, real)
        metrics = run(config.model_copy(update={"resume": True}))
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert_accounting(metrics)
    trained = [r for r in rollouts(config, 1) if r["trained"]]
    assert sum(m["rollouts/all/trained"] for m in metrics if m["step"] == 1) == len(trained) > 0
    assert {mb.header.step for mb in received(config, 3)} == {0, 1, 2}


def test_a_start_killed_before_its_first_commit_runs_and_logs_the_first_eval_once(tmp_path, monkeypatch):
    real, calls = Orchestrator._save, []

    def dies_at_step_0_after_the_eval(self, *args):
        calls.append(1)
        if len(calls) == 1:
            path = Path(self.output_dir) / "orchestrator" / "metrics.jsonl"
            deadline = time.monotonic() + 120  # the first eval runs beside step 0: let it log first
            while time.monotonic() < deadline:
                if path.exists() and "eval/" in path.read_text():
                    raise Killed
                time.sleep(0.05)
            raise AssertionError("the eval at step 0 never logged")
        return real(self, *args)

    with FakeServer() as server:
        config = make_config(
            tmp_path, server, max_steps=2,
            eval={"interval": 10, "at_start": True, "envs": [{"id": "reverse-text", "name": "rt-eval", "num_examples": 5}]},
        )  # fmt: skip
        monkeypatch.setattr(Orchestrator, "_save", dies_at_step_0_after_the_eval)
        with pytest.raises(Killed):
            run(config)
        monkeypatch.setattr(Orchestrator, "_save", real)
        metrics = run(config)
    # Nothing was committed, so the run started over: eval at 0 again, its old record dropped.
    records = sorted((m["step"], "eval/rt-eval/rollouts" in m) for m in metrics)
    assert records == [(0, False), (0, True), (1, False)]


def test_fresh_start_refuses_a_used_output_dir(tmp_path):
    from prime_rl.orchestrator.loop.progress import RunDirError

    with FakeServer() as server:
        run(make_config(tmp_path, server, max_steps=1))
        with pytest.raises(RunDirError, match="holds a previous run"):
            run(make_config(tmp_path, server, max_steps=1, resume=False))


def test_a_fifth_of_rollouts_failing_still_trains_every_step(tmp_path, caplog):
    # Failures by request index, and one group in flight at a time (4 rollouts), so each failure
    # is collected in its own group whatever the machine's speed; a timed-out group finishes
    # before the next starts. At most one failure falls in any 4 consecutive requests.
    def script(req, i):
        if i % 15 == 3:
            return Reply(delay_s=6.0)  # past the client's timeout
        if i % 15 == 7:
            return Reply(status=500)
        if i % 15 == 11:
            return Reply(truncate=True)  # no token ids: the env's rollout is unusable
        return Reply(text=user_text(req)[::-1][: 1 + i % 4])  # distinct rewards: nothing filtered

    caplog.set_level(logging.INFO, logger="prime_rl")
    with FakeServer(script) as server:
        config = make_config(
            tmp_path, server, max_steps=4, batch_size=16, max_inflight_rollouts=4,
            client={"base_urls": [server.base_url], "timeout_s": 2, "health_timeout_s": 10,
                    "group_requests": False},  # one request per rollout: failures hit single rollouts
        )  # fmt: skip
        metrics = run(config)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert_accounting(metrics)  # trained + filtered + failed + stale + pending = dispatched, every step
    assert all(m["rollouts/all/trained"] > 0 for m in metrics)
    failed = sum(m["rollouts/all/failed"] for m in metrics)
    finished = sum(m["rollouts/all/trained"] + m["rollouts/all/filtered"] for m in metrics) + failed
    assert 0.15 < failed / finished < 0.25, (failed, finished)
    # Each failure is one log line with its reason; a step with failures warns once, naming the
    # most common reason.
    lines = [r.getMessage() for r in caplog.records]
    logged = sum(line.startswith("rollout failed:") for line in lines)
    assert failed <= logged <= failed + 4  # + a group that may finish after the last step
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    steps_with_failures = [m["step"] for m in metrics if m["rollouts/all/failed"]]
    assert [int(w.split()[1].rstrip(":")) for w in warnings if "rollouts failed" in w] == steps_with_failures
    recs = [r for s in range(4) for r in rollouts(config, s)]
    errors = " ".join(r["error"] for r in recs if r["trained"] is None)
    assert "500" in errors and "imeout" in errors and "token ids" in errors
    groups: dict = {}
    for r in recs:
        if r["trained"]:
            groups.setdefault((r["step"], r["example_id"]), []).append(r["advantage"])
    assert any(len(g) < 4 for g in groups.values())  # partial groups train on their survivors
    assert all(math.isclose(sum(g), 0.0, abs_tol=1e-9) for g in groups.values())


def test_a_server_that_never_finishes_a_request_fails_rollouts_by_timeout_then_stops_the_run(
    tmp_path, env_workers
):
    # The server takes every request and never answers in time: each rollout fails at the client's
    # timeout, and the run stops at the failure bound rather than waiting forever.
    with FakeServer(lambda req, i: Reply(delay_s=4)) as server:
        config = make_config(tmp_path, server, env_workers=env_workers, max_failed_groups=2,
                             client={"base_urls": [server.base_url], "timeout_s": 0.5, "health_timeout_s": 10})  # fmt: skip
        with pytest.raises(RolloutsFailing, match="the last 2 groups failed entirely") as e:
            run(config)
    assert "TimeoutError" in str(e.value)  # failed by the client's timeout, not by the server


def test_an_eval_env_whose_rollouts_all_fail_stops_the_run(tmp_path, env_workers):
    # Training answers; evaluation (greedy requests) always gets HTTP 500.
    with FakeServer(lambda req, i: Reply(status=500) if req.get("temperature") == 0.0 else Reply()) as server:
        config = make_config(
            tmp_path, server, env_workers=env_workers, max_steps=50, max_failed_groups=3,
            eval={"interval": 1, "at_start": True, "envs": [{"id": "reverse-text", "name": "rt-eval", "num_examples": 8}]},
        )  # fmt: skip
        with pytest.raises(RolloutsFailing, match="eval env 'rt-eval': the last 3 groups failed entirely"):
            run(config)
    # The eval runs in the background, and the step loop stops for its failure: before max_steps
    # (how many steps go first depends on the machine; none, some).
    metrics = Path(config.output_dir) / "orchestrator" / "metrics.jsonl"
    assert len(read_metrics(metrics) if metrics.exists() else []) < 50


def test_partial_failures_reset_the_failure_bound_and_unreachable_servers_are_bounded_by_time():
    from prime_rl.orchestrator.loop.failures import FailureStreak
    from prime_rl.orchestrator.rollout import Rollout

    def group(*errors):
        return [Rollout("e", 0, 0, error=err) for err in errors]

    streak = FailureStreak(limit=2, unreachable_s=3600)
    down = "env error: ModelError() -> APIConnectionError('Connection error.') -> ConnectError('refused')"
    for _ in range(5):  # a restarting server fails whole groups: bounded by time, not by count
        streak.record("e", group(down, down))
    streak.record("e", group("reward error: ValueError('x')", None))  # a survivor resets the count
    streak.record("e", group("reward error: ValueError('x')"))
    streak.record("e", group(None, None))
    streak.record("e", group("env error: APITimeoutError('Request timed out.')"))
    with pytest.raises(RolloutsFailing, match="most common reason: APITimeoutError") as e:
        streak.record("e", group("env error: APITimeoutError('Request timed out.')"))
    assert e.value.retryable  # a server's timeouts: a restart may help
    bug = FailureStreak(limit=1)
    with pytest.raises(RolloutsFailing) as e:
        bug.record("e", group("reward error: ValueError('bug')", "reward error: ValueError('bug')"))
    assert not e.value.retryable  # the env's own exception: never retried
    gone = FailureStreak(limit=2, unreachable_s=0.0)
    gone.record("e", group(down))
    with pytest.raises(RolloutsFailing, match=r"no server could be reached .* client.health_timeout_s = 0"):
        gone.record("e", group(down))
