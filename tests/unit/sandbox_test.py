"""The local sandbox, escaped from the inside (real bubblewrap): the network, the run's secret and
files, other processes' environment, writes outside its scratch folder, and bombs of processes,
memory, CPU, time and output are each contained, the run says how it ended, and nothing it started
is left behind."""

import ast
import asyncio
import os
import socket
import sys
import threading
from pathlib import Path

import pytest

from prime_rl.sandbox.bwrap import python_paths
from prime_rl.sandbox.config import SandboxConfig
from prime_rl.sandbox.run import run

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="namespaces are Linux's")


def sandboxed(code: str, **limits):
    config = SandboxConfig(**{"timeout_s": 20, **limits})
    return asyncio.run(run([sys.executable, "-c", code], config, read_only=python_paths()))


def uid_of(result) -> int:
    return int(result.stdout.split()[0])


def left_behind(uid: int) -> list[str]:
    """Processes of the sandbox's user still running (a zombie is dead: its reaper may be slow)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if os.stat(f"/proc/{pid}").st_uid == uid and stat.rsplit(")", 1)[1].split()[0] != "Z":
                pids.append(f"{pid} {stat.split(')')[0]}")
        except OSError:
            pass
    return pids


def test_plain_code_runs_in_its_scratch_folder_with_a_cleared_environment(monkeypatch):
    monkeypatch.setenv("PRIME_RL_SECRET_FILE", "/nowhere")
    r = sandboxed("import os; print(sorted(os.environ)); open('note', 'w').write('x'); print(os.getcwd())")
    assert r.ok, r.stderr
    names, cwd = r.stdout.splitlines()
    assert "PRIME_RL_SECRET_FILE" not in names and "prime-rl-sandbox-" in cwd
    assert not os.path.exists(cwd)  # the scratch folder is gone with the run


def test_the_runs_ports_on_loopback_cannot_be_reached():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted = []
    server.settimeout(None)
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    r = sandboxed(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5)")
    assert r.reason == "error" and "ConnectionRefusedError" in r.stderr, r.stderr
    assert not accepted
    server.close()


def test_the_runs_secret_files_and_other_processes_are_out_of_sight(tmp_path, monkeypatch):
    secret = tmp_path / "run" / ".secret"
    secret.parent.mkdir()
    secret.write_text("root key")
    secret.chmod(0o600)
    (tmp_path / "run" / "checkpoints").mkdir()
    monkeypatch.setenv("PRIME_RL_SECRET_FILE", str(secret))
    code = f"""
import os
for path in [{str(secret)!r}, {str(tmp_path / "run" / "checkpoints")!r}, "/proc/{os.getpid()}/environ",
             os.environ.get("PRIME_RL_SECRET_FILE", "")]:
    try:
        open(path).read() if not os.path.isdir(path) else os.listdir(path)
        print("READ", path)
    except OSError as e:
        print("no", type(e).__name__)
"""
    r = sandboxed(code)
    assert r.ok, r.stderr
    assert "READ" not in r.stdout and r.stdout.count("no ") == 4, r.stdout


def test_writes_outside_the_scratch_folder_fail():
    code = """
import os, sys
for path in ["/etc/passwd2", "/usr/x", sys.prefix + "/x", "/x"]:
    try:
        open(path, "w").write("x")
        print("WROTE", path)
    except OSError as e:
        print("no", type(e).__name__)
"""
    r = sandboxed(code)
    assert r.ok and "WROTE" not in r.stdout and r.stdout.count("no ") == 4, r.stdout + r.stderr


def test_a_fork_bomb_stops_at_the_process_limit_and_leaves_nothing():
    code = """
import os, time
print(os.getuid(), flush=True)
n = 0
try:
    while True:
        os.fork() or time.sleep(30)
        n += 1
except OSError as e:
    print("refused after", n, type(e).__name__, flush=True)
    os._exit(3)
"""
    r = sandboxed(code, processes=16, timeout_s=30)
    assert r.reason == "error" and "refused after" in r.stdout, (r.reason, r.stdout, r.stderr)
    assert int(r.stdout.split("refused after")[1].split()[0]) < 16
    if os.geteuid() == 0:
        assert left_behind(uid_of(r)) == []


def test_a_memory_bomb_is_a_memory_failure():
    r = sandboxed("x = bytearray(4 * 1024**3)", memory_mb=256)
    assert r.reason == "memory", (r.reason, r.stderr)


def test_an_infinite_loop_is_stopped_by_its_cpu_seconds_or_its_deadline():
    r = sandboxed("while True: pass", cpu_s=1, timeout_s=60)
    assert r.reason in ("cpu", "timeout"), (r.reason, r.stderr)


def test_a_sleep_past_the_deadline_is_killed_with_everything_it_started():
    code = "import os, subprocess, time; print(os.getuid(), flush=True); subprocess.Popen(['sleep', '600']); time.sleep(600)"
    r = sandboxed(code, timeout_s=2)
    assert r.reason == "timeout"
    if os.geteuid() == 0:
        assert left_behind(uid_of(r)) == []


def test_a_background_process_does_not_outlive_the_run():
    code = "import os, subprocess; print(os.getuid()); subprocess.Popen(['sleep', '600'], start_new_session=True)"
    r = sandboxed(code)
    assert r.ok, r.stderr
    if os.geteuid() == 0:
        assert left_behind(uid_of(r)) == []


def test_a_gigabyte_of_output_is_cut_at_the_cap_and_the_run_killed():
    r = sandboxed("import sys\nwhile True: sys.stdout.write('x' * 65536)", output_kb=64)
    assert r.reason == "output" and len(r.stdout) == 64 * 1024


def test_this_machine_can_sandbox_and_a_missing_bubblewrap_says_how_to_get_it(monkeypatch):
    from prime_rl.sandbox import bwrap

    bwrap.check()  # CI installs bubblewrap (.ci/run): the sandbox is real here
    monkeypatch.setenv("PATH", "/nonexistent")
    bwrap.check.cache_clear()
    with pytest.raises(
        bwrap.SandboxUnavailable, match=r"bubblewrap \(`bwrap`\) is not installed: install it"
    ):
        bwrap.check()
    bwrap.check.cache_clear()


def test_a_path_it_may_read_under_tmp_is_there_in_its_own_tmp(tmp_path):
    """A checkout (or venv) under /tmp: bound on top of the sandbox's own empty /tmp."""
    shared = tmp_path / "checkout"
    shared.mkdir()
    (shared / "tool.txt").write_text("found")
    shared.chmod(0o755)
    for parent in shared.parents:  # pytest's folders are the user's alone: opened to read
        if str(parent).startswith("/tmp/"):
            parent.chmod(parent.stat().st_mode | 0o005)
    (shared / "tool.txt").chmod(0o644)
    code = f"import os; print(open({str(shared / 'tool.txt')!r}).read()); print(sorted(os.listdir('/tmp')))"
    paths = [*python_paths(), str(shared)]
    r = asyncio.run(run([sys.executable, "-c", code], SandboxConfig(), read_only=paths))
    assert r.ok, r.stderr
    found, listing = r.stdout.splitlines()
    # Its /tmp holds the folders above what it may read, and its scratch folder: nothing else of /tmp.
    above = {Path(p).parts[2] for p in paths if p.startswith("/tmp/")}
    assert found == "found"
    assert all(name in above or name.startswith("prime-rl-sandbox-") for name in ast.literal_eval(listing))
