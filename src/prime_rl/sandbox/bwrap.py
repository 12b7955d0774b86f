"""The bubblewrap command line of one sandbox run.

Invariant: the sandbox sees only the system's programs and libraries, the paths it is given to read
(all read-only) and its scratch folder (read-write, its home and working folder); it has its own
PID, IPC and UTS namespaces, its own network namespace unless allowed the network, a fresh /proc
(no other process's environment), a cleared environment, and dies with the process that started it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

SYSTEM = ("/usr", "/bin", "/lib", "/lib64", "/lib32", "/sbin", "/etc/alternatives", "/etc/ld.so.cache")
"""The system's programs and libraries (those that exist are bound, read-only)."""

SANDBOX_USER = 200_000
"""First user id of the sandboxes when started by root: each sandbox runs as a user of its own, so
that its process limit is its own and the run's files (the user's, mode 600) stay unreadable."""


class SandboxUnavailable(RuntimeError):
    """This machine cannot sandbox (no bubblewrap, or no namespaces for it)."""


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(
            "bubblewrap (`bwrap`) is not installed: install it (Debian/Ubuntu: `apt-get install "
            "bubblewrap`), or pick a remote runtime for the env"
        )
    return path


@functools.cache
def check() -> None:
    """That this machine can sandbox: bubblewrap is installed and may make its namespaces (a user
    namespace, where the caller is not root). Raises `SandboxUnavailable` naming the cause and the fix."""
    bwrap = bwrap_path()
    user = [] if os.geteuid() == 0 else ["--unshare-user"]
    probe = [bwrap, *user, "--unshare-pid", "--unshare-net", "--ro-bind", "/", "/", "--", "true"]
    done = subprocess.run(probe, capture_output=True, text=True)
    if done.returncode != 0:
        why = (
            done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
        )
        raise SandboxUnavailable(
            f"bubblewrap cannot make a sandbox here ({why}): enable unprivileged user namespaces "
            "(`sysctl -w kernel.unprivileged_userns_clone=1`, or `kernel.apparmor_restrict_unprivileged_userns=0` "
            "on Ubuntu 24.04), run as root, or pick a remote runtime for the env"
        )


def python_paths() -> list[str]:
    """The Python this process runs and the folders its imports come from (site-packages, editable
    installs' source folders), which the sandbox may read to run Python code."""
    paths = {sys.prefix, sys.base_prefix, str(Path(sys.executable).resolve().parents[1])}
    paths |= {p for p in sys.path if p and Path(p).is_dir()}
    return sorted(p for p in paths if p != "/" and Path(p).exists())


def command(
    argv: list[str],
    scratch: Path,
    read_only: list[str],
    network: bool,
    uid: int | None,
    status_fd: int,
    env: dict[str, str] | None = None,
) -> list[str]:
    """`argv` run in the sandbox, in `scratch`; `uid`: the user it runs as (root starts it), None:
    the caller's own (inside an unprivileged user namespace); bubblewrap writes its JSON status
    (the pid of the sandbox's first process) to `status_fd`."""
    cmd = [
        bwrap_path(),
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--json-status-fd",
        str(status_fd),
    ]
    cmd += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if not network:
        cmd.append("--unshare-net")
    if uid is None:
        cmd.append("--unshare-user")
    paths = [p for p in dict.fromkeys([*SYSTEM, *read_only]) if os.path.exists(p)]
    # /tmp first: a path it may read that lies under /tmp (a checkout there) is bound on top of it.
    cmd += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    # The folders above a bound path are made by bubblewrap, root's and closed (0700) by default:
    # opened here, or its own user could not reach what it may read.
    above = {str(a) for p in paths for a in Path(p).parents if str(a) != "/"}
    for folder in sorted(above, key=lambda f: f.count("/")):
        cmd += ["--perms", "0755", "--dir", folder]
    for path in paths:
        cmd += ["--ro-bind", path, path]
    cmd += ["--bind", str(scratch), str(scratch), "--chdir", str(scratch)]
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(scratch),
        "LANG": "C.UTF-8",
        "TMPDIR": "/tmp",
        **(env or {}),
    }
    for key, value in env.items():
        cmd += ["--setenv", key, value]
    if uid is not None:  # root sets the sandbox up, then the command runs as the slot's own user
        cmd += ["--", "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        cmd += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    else:
        cmd.append("--")
    return cmd + argv
