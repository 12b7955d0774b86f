"""The sandboxed tool host: a session per rollout forked from one host that imported the tools once;
calls answered, a tool's error an answer, state not shared between sessions, and a tool that hangs,
spins, crashes or prints without end fails its call alone: the host serves the next session."""

import asyncio
from pathlib import Path

import pytest

from prime_rl.sandbox.config import SandboxConfig
from prime_rl.sandbox.tools_host import ToolFailed, ToolsHost

HELPERS = str(Path(__file__).resolve().parents[1])


def with_host(scenario, **limits):
    async def go():
        host = await ToolsHost.start(["helpers.sandbox_tools"], SandboxConfig(**limits), paths=[HELPERS])
        try:
            return await scenario(host)
        finally:
            await host.close()

    return asyncio.run(go())


def test_calls_are_answered_and_sessions_share_no_state(tmp_path):
    secret = tmp_path / ".secret"
    secret.write_text("root key")
    secret.chmod(0o600)

    async def scenario(host):
        one, two = await host.session(), await host.session()
        sums = [await one.call("helpers.sandbox_tools:add", {"a": 2, "b": 3}, 10) for _ in range(3)]
        counts = [await s.call("helpers.sandbox_tools:calls", {}, 10) for s in (one, two)]
        with pytest.raises(ValueError, match="FileNotFoundError"):
            await two.call("helpers.sandbox_tools:secret", {"path": str(secret)}, 10)
        for s in (one, two):
            await s.close()
        return sums, counts

    sums, counts = with_host(scenario)
    assert sums == [5, 5, 5] and counts == [3, 0]


@pytest.mark.parametrize(
    ("tool", "reason"),
    [("sleep", "timeout"), ("spin", "died"), ("crash", "died")],
)
def test_a_tool_that_hangs_spins_or_crashes_fails_its_call_and_the_host_goes_on(tool, reason):
    async def scenario(host):
        session = await host.session()
        kwargs = {"seconds": 600} if tool == "sleep" else {}
        with pytest.raises(ToolFailed) as failed:
            await session.call(f"helpers.sandbox_tools:{tool}", kwargs, 3 if tool == "sleep" else 600)
        await session.close()
        after = await host.session()
        return failed.value.reason, await after.call("helpers.sandbox_tools:add", {"a": 1, "b": 1}, 10)

    got, two = with_host(scenario, cpu_s=1)
    assert (got, two) == (reason, 2)


def test_what_a_tool_prints_never_blocks_it():
    async def scenario(host):
        session = await host.session()
        return await session.call("helpers.sandbox_tools:chatty", {}, 60)

    assert with_host(scenario) == "done"
