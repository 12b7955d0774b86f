"""A v1 env's tools run in its sandboxed tool host: the same results and errors as in process, the
host started at the first tool call (not before), as a user of its own, and gone with the env."""

import asyncio
import json
import os
from pathlib import Path

import psutil
import pytest

from helpers.scripted import Scripted
from prime_rl.engine.sampling import SamplingArgs
from prime_rl.orchestrator.envs.renderer import Renderer
from prime_rl.orchestrator.envs.v1_env import load_v1_env
from prime_rl.sandbox.config import SandboxConfig

TOOL_MODEL = str(Path(__file__).parents[2] / "models" / "tool_add-tiny")


def call(a, b) -> str:
    return f'<tool_call>\n{{"name": "add", "arguments": {json.dumps({"a": a, "b": b})}}}\n</tool_call>'


def descends_from_us(pid: int) -> bool:
    """Whether `pid` was started (at any depth) by this process: other tests run hosts beside ours."""
    while pid > 1:
        if pid == os.getpid():
            return True
        pid = parent(pid)
    return False


def hosts_of_ours() -> set[int]:
    """The sandbox hosts this process started (at any depth), a test of this worker's included that
    keeps one running beside ours."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if (
                b"prime_rl.sandbox.host" in args
                and not args[0].endswith(b"bwrap")
                and descends_from_us(int(pid))
            ):
                found.add(int(pid))
        except OSError:
            pass
    return found


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def host_process(before: set[int]) -> tuple[int, int]:
    """(pid, user) of the tool host this test started: the one not running `before` whose parent is
    no host (its sessions are forks of it, with its command line)."""
    new = hosts_of_ours() - before
    roots = [pid for pid in new if parent(pid) not in new]
    assert len(roots) == 1, f"tool hosts started by this test: {sorted(new)}"
    return roots[0], os.stat(f"/proc/{roots[0]}").st_uid


def test_tool_add_calls_its_tool_in_the_sandbox_with_the_same_results():
    replies = [call(1, 2), '<tool_call>\n{"name": "mul", "arguments": {}}\n</tool_call>', "3"]

    async def go():
        before = hosts_of_ours()
        env = load_v1_env("tool-add", {}, SandboxConfig())
        renderer = Renderer.for_model(TOOL_MODEL)
        started_before = env.host is not None
        try:
            (rollout,) = await env.run_group(
                env.first, 0, 1, Scripted(renderer, replies), renderer, "m", SamplingArgs(max_tokens=32),
                "tool-add", 0, [], 60,
            )  # fmt: skip
            host_pid, uid = host_process(before)
        finally:
            await env.close()
        return started_before, rollout, uid, host_pid

    started_before, r, uid, host_pid = asyncio.run(go())
    assert not started_before
    assert not r.failed and (r.tool_calls, r.tool_errors) == (2, 1), r.error
    assert r.completion[1]["content"] == "3"
    assert r.completion[3]["content"].startswith("Error: no tool named 'mul'")
    if os.geteuid() == 0:
        assert uid != 0  # the tools ran as the sandbox's own user
    # Gone once closed: waited for, since the host ends after `close` returns (its parent reaps it).
    try:
        _, alive = psutil.wait_procs([psutil.Process(host_pid)], timeout=120)
    except psutil.NoSuchProcess:
        alive = []
    assert not alive, [(p.pid, p.ppid(), p.status(), p.cmdline()) for p in alive]


def test_an_env_with_tools_stops_in_one_line_where_the_machine_cannot_sandbox(monkeypatch):
    from prime_rl.environments import EnvError
    from prime_rl.sandbox import bwrap

    monkeypatch.setattr(bwrap.shutil, "which", lambda name: None)
    bwrap.check.cache_clear()
    try:
        with pytest.raises(EnvError) as stopped:
            load_v1_env("tool-add", {}, SandboxConfig())
    finally:
        bwrap.check.cache_clear()
    message = str(stopped.value)
    assert message.startswith(
        "env 'tool-add': its tools cannot run sandboxed: bubblewrap (`bwrap`) is not installed"
    )
    assert 'runtime = "none"' in message and "\n" not in message
    # An env without tools needs no sandbox; the explicit opt-out runs the tools in process.
    assert load_v1_env("reverse-text", {}, SandboxConfig()).sandbox is not None
    assert load_v1_env("tool-add", {}, SandboxConfig(runtime="none")).sandbox is None


def test_the_host_side_is_the_module_the_orchestrator_names_to_the_host():
    """The orchestrator's side names the host's by a string (so that neither imports the other in a
    circle): that string loads the host's entry points."""
    import importlib

    from prime_rl.orchestrator.envs.sandboxed_tools import HOST

    session = importlib.import_module(HOST)
    assert all(callable(getattr(session, name, None)) for name in ("preload", "open_tools", "call_tool"))
