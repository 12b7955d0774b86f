"""The sandboxed tool host: sessions served by warm workers forked from one host that imported the
tools once; calls answered, a tool's error an answer, each session in an empty scratch folder of its
own with nothing left running from the one before, and a tool that hangs, spins, crashes, runs out
of memory or prints without end fails its call alone: the host serves the next session."""

import asyncio
import os
import secrets
from pathlib import Path

import pytest

from prime_rl.sandbox import tools_host
from prime_rl.sandbox.config import SandboxConfig
from prime_rl.sandbox.tools_host import ToolFailed, ToolsHost

HELPERS = str(Path(__file__).resolve().parents[1])
TOOLS = "helpers.sandbox_tools"


def with_host(scenario, **limits):
    async def go():
        host = await ToolsHost.start([TOOLS], SandboxConfig(**limits), paths=[HELPERS])
        try:
            return await scenario(host)
        finally:
            await host.close()

    return asyncio.run(go())


async def one_session(host, fn: str, **kwargs):
    session = await host.session(10)
    try:
        return session.pid, await session.call(f"{TOOLS}:{fn}", kwargs, 10)
    finally:
        await session.close()


def test_calls_are_answered_and_open_sessions_share_no_state(tmp_path):
    secret = tmp_path / ".secret"
    secret.write_text("root key")
    secret.chmod(0o600)

    async def scenario(host):
        one, two = await host.session(10), await host.session(10)
        sums = [await one.call(f"{TOOLS}:add", {"a": 2, "b": 3}, 10) for _ in range(3)]
        counts = [await s.call(f"{TOOLS}:calls", {}, 10) for s in (one, two)]
        with pytest.raises(ValueError, match=r"FileNotFoundError|PermissionError"):
            await two.call(f"{TOOLS}:secret", {"path": str(secret)}, 10)
        for s in (one, two):
            await s.close()
        return sums, counts, one.pid != two.pid

    sums, counts, apart = with_host(scenario)
    assert sums == [5, 5, 5] and counts == [3, 0] and apart


@pytest.mark.parametrize("per_worker", [64, 1])
def test_a_worker_serves_sessions_in_turn_each_in_an_empty_folder(per_worker):
    async def scenario(host):
        return [await one_session(host, "scratch") for _ in range(3)]

    sessions = with_host(scenario, sessions_per_worker=per_worker)
    pids = {pid for pid, _ in sessions}
    folders = [folder for _, (folder, _) in sessions]
    assert all(before == [] for _, (_, before) in sessions)  # the last one's file is gone
    assert len(set(folders)) == 3
    # Warm: one worker served all three; one per worker: a fresh process each time.
    assert len(pids) == (1 if per_worker > 1 else 3)


def unique_tag() -> str:
    """Tells this test's `sleep` from any other's (tests run side by side)."""
    return str(1_000_000 + secrets.randbelow(10**9))


def sleepers(tag: str) -> list[int]:
    """Processes (outside the sandbox's view) running the `sleep` that `leave_behind(tag)` started."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] == [
                b"sleep",
                f"{tag}.5".encode(),
            ]:
                found.append(int(pid))
        except OSError:
            pass
    return found


def test_a_process_a_session_leaves_behind_is_killed_and_its_worker_replaced():
    tag = unique_tag()

    async def scenario(host):
        session = await host.session(10)
        await session.call(f"{TOOLS}:leave_behind", {"tag": tag}, 10)
        started = sleepers(tag)
        await session.close()
        # The worker found the process at its session's end and left; the host then killed it.
        while sleepers(tag):
            await asyncio.sleep(0.01)
        after, _ = await one_session(host, "add", a=1, b=1)
        return session.pid, after, started

    pid, after, started = with_host(scenario)
    assert started  # it did outlive the call
    assert after != pid


@pytest.mark.parametrize(
    ("tool", "reason"),
    [("sleep", "timeouts"), ("spin", "killed"), ("crash", "killed"), ("memory", "oom"), ("long", "output")],
)
def test_a_tool_that_hangs_spins_crashes_or_blows_memory_fails_its_call_and_the_host_goes_on(tool, reason):
    async def scenario(host):
        session = await host.session(10)
        kwargs = {"seconds": 600} if tool == "sleep" else {}
        with pytest.raises(ToolFailed) as failed:
            await session.call(f"{TOOLS}:{tool}", kwargs, 3 if tool == "sleep" else 600)
        await session.close()
        _, two = await one_session(host, "add", a=1, b=1)
        return failed.value.reason, two

    got, two = with_host(scenario, cpu_s=1, memory_mb=256, output_kb=64)
    assert (got, two) == (reason, 2)


def test_what_a_tool_prints_never_blocks_it():
    async def scenario(host):
        return (await one_session(host, "chatty"))[1]

    assert with_host(scenario) == "done"


def test_a_slow_call_in_flight_is_named_for_the_watchdog(monkeypatch):
    monkeypatch.setattr(tools_host, "SLOW_S", 0.0)

    async def scenario(host):
        session = await host.session(10)
        what = "env 'x', tool sleep"
        call = asyncio.ensure_future(session.call(f"{TOOLS}:sleep", {"seconds": 600}, 2, what))
        while not tools_host.slow_call():
            await asyncio.sleep(0.01)
        named = tools_host.slow_call()
        with pytest.raises(ToolFailed):
            await call
        return named, tools_host.slow_call()

    named, after = with_host(scenario)
    assert named.startswith("a sandboxed tool call (env 'x', tool sleep) running since ")
    assert after == ""  # ended (at its deadline): not named any more


def test_a_call_whose_rollout_is_cancelled_is_killed_with_what_it_started(monkeypatch):
    monkeypatch.setattr(tools_host, "SLOW_S", 0.0)
    tag = unique_tag()

    async def scenario(host):
        session = await host.session(10)
        call = asyncio.ensure_future(session.call(f"{TOOLS}:wait_on", {"tag": tag}, 600))
        while not sleepers(tag):
            await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        while sleepers(tag):  # the worker's group killed: the call's process with it
            await asyncio.sleep(0.01)
        return (await one_session(host, "add", a=2, b=2))[1]

    assert with_host(scenario) == 4
