"""Env workers (`orchestrator.env_workers`): the same rollouts as in process, and a worker that dies
fails only the groups it was running, which are counted, while the run goes on."""

import json
import os
import re
import signal
from pathlib import Path

import msgspec
from orchestrator_test import assert_accounting, make_config, received, rollouts, run

from fake_server import FakeServer, Reply, user_text


def worker_pids() -> list[int]:
    """The env worker processes of this (test) process."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"prime_rl.orchestrator.envs.worker" in cmdline:
            pids.append(int(entry))
    return pids


def comparable(record: dict) -> tuple:
    """A rollouts-log record without what depends on timing (which step took its group)."""
    keep = ("env", "example_id", "reward", "advantage", "trained", "prompt", "completion",
            "completion_tokens", "turns", "metrics", "error", "answer")  # fmt: skip
    text = (json.dumps(record.get(k), sort_keys=True) for k in keep)
    return tuple(re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", t) for t in text)  # each run, its server


def test_in_process_and_env_workers_give_the_same_rollouts_rewards_and_samples(tmp_path):

    # One group at a time, so that every step takes the same groups in both modes; a third of the
    # examples fail (by their text, not by the order of requests) and a half answer wrong.
    def script(req, i):
        text = user_text(req)
        if sum(text.encode()) % 3 == 0:
            return Reply(status=500)
        return Reply() if sum(text.encode()) % 2 else Reply(text="wrong")

    results = {}
    for workers in (0, 2):
        with FakeServer(script) as server:
            config = make_config(
                tmp_path / f"w{workers}", server, env_workers=workers, max_inflight_rollouts=4,
                envs=[{"id": "reverse-text", "group_size": 4, "sampling": {"max_tokens": 16},
                       "state_columns": ["answer"]}],
            )  # fmt: skip
            metrics = run(config)
        assert_accounting(metrics)
        logs = [sorted(comparable(r) for r in rollouts(config, step)) for step in range(3)]
        # tokens, advantages, masks (not the sender's contract: its session is new every start)
        samples = [
            msgspec.msgpack.encode(msgspec.structs.replace(mb, orchestrator=None))
            for mb in received(config, 3)
        ]
        counts = [
            {k: m[k] for k in m if k.startswith("rollouts/") or k.startswith("reward/")} for m in metrics
        ]
        results[workers] = (logs, sorted(samples), counts)
    assert any(r[10] != "null" for step in results[0][0] for r in step)  # failures are among them
    assert results[0] == results[2]


def test_a_worker_killed_mid_group_fails_its_rollouts_counted_and_the_run_goes_on(tmp_path):
    killed = []

    def script(req, i):
        if i == 5 and not killed:  # a group is waiting on this reply: kill the worker running it
            (pid,) = worker_pids()
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return Reply(delay_s=0.5)
        return Reply()

    with FakeServer(script) as server:
        config = make_config(tmp_path, server, env_workers=1, max_steps=4)
        metrics = run(config)
    assert killed and len(worker_pids()) == 0  # the worker is gone after the run, the restarted one too
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert_accounting(metrics)
    died = [r for step in range(4) for r in rollouts(config, step) if r["error"]]
    assert died and all(
        r["error"].startswith("EnvWorkerDied: env worker 0 exited with status -9") for r in died
    )
    assert sum(m["rollouts/all/failed"] for m in metrics) == len(died)
    assert len(died) % 4 == 0  # whole groups: those the worker was running
    assert all(m["rollouts/all/trained"] == 8 for m in metrics)


def test_a_cancelled_job_gets_no_answer_and_its_worker_takes_the_next(tmp_path):
    """What the scheduler does to a group past the off-policy bound: the job is cancelled in its
    worker; no answer arrives for it later, and the worker serves the next job at once: while the
    server still holds the cancelled job's request (it would answer it only after the test)."""
    import asyncio

    from prime_rl.orchestrator.envs.local import LocalEnvs
    from prime_rl.orchestrator.loop.examples import ExampleSource
    from prime_rl.orchestrator.loop.workers import WorkerPool
    from prime_rl.orchestrator.messages import GroupJob

    with FakeServer(lambda req, i: Reply(delay_s=600.0) if i == 0 else Reply()) as server:
        config = make_config(tmp_path, server, env_workers=1)

        async def go():
            pool = WorkerPool(config, LocalEnvs(config, rollouts=False))
            (env,), _ = await pool.start()
            example = ExampleSource(env.examples, 0).next()
            try:
                slow = asyncio.create_task(
                    pool.run(GroupJob(0, env.name, example.example_id, example.task, 4, 0, server.base_url))
                )
                while not server.requests:  # the group's request is at the server, which holds it
                    await asyncio.sleep(0.02)
                slow.cancel()
                try:
                    await slow
                    raise AssertionError("a cancelled job was answered")
                except asyncio.CancelledError:
                    pass
                job = GroupJob(1, env.name, example.example_id, example.task, 4, 0, server.base_url)
                # (A worker still waiting for the cancelled request would answer after 600 s.)
                rollouts = await asyncio.wait_for(pool.run(job), 300)
                return rollouts, dict(pool.workers[0].jobs)
            finally:
                await pool.close()

        rollouts, pending = asyncio.run(go())
    assert len(rollouts) == 4 and not any(r.failed for r in rollouts)
    assert pending == {}
