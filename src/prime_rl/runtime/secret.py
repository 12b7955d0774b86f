"""The run secret: what lets the processes of one run (and the servers they use) tell each other
apart from anyone else on the cluster's network.

Where it comes from, in this order: `PRIME_RL_SECRET` (the value), `PRIME_RL_SECRET_FILE` (a file
holding it, readable by its owner only). `rl` makes one per run, a file under its output folder, and
hands it to the processes it starts through `PRIME_RL_SECRET_FILE`, so that it is never in a config
file, a command line, the console or W&B. Processes started by hand read the same variables; with
neither set they take the run's file in their output folder, made by the first of them (`ensure`).
Only with `PRIME_RL_NO_SECRET=1` is there no secret: every check below then lets everything through
(the loopback-only defaults are the only protection, and a server refuses a non-loopback bind:
`require_for_bind`).

Invariant: the secret's value never leaves this module, nor the process: every use derives its own
key from it (`key(label)`), so no two uses share bytes and none of them can give the secret away.
Requests to the run's servers are signed with one of these keys (`auth/signing.py`).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import os
import secrets
import stat
from pathlib import Path

ENV = "PRIME_RL_SECRET"
FILE_ENV = "PRIME_RL_SECRET_FILE"
NO_SECRET_ENV = "PRIME_RL_NO_SECRET"
"""Set to 1, a process started by hand runs without a secret (loopback only, as before it had one
by default): the explicit opt-out."""
FILE_NAME = ".secret"
"""The file `rl` keeps the run's secret in, under its output folder (0600): a resumed run finds the
same secret, so checkpoint manifests keyed by it still verify."""
HEADER = "authorization"
OPT_OUT_FLAG = "--prime-rl-allow-unauthenticated"
OWNER_HEADER = "X-Prime-RL-Owner"
"""Names the caller of `GET /prime_rl/adapters`: its owner token."""


class SecretError(ValueError):
    """The secret file is missing, empty or readable by others: one line naming it."""


@functools.cache
def value() -> str | None:
    """This process's secret, None when none is configured. (Read once: the environment does not
    change under a running process.)"""
    direct = os.environ.get(ENV, "").strip()
    if direct:
        return direct
    path = os.environ.get(FILE_ENV, "").strip()
    return read(Path(path)) if path else None


def read(path: Path) -> str:
    """The secret in `path`, refused (one line) when others than its owner may read it, as ssh does
    for a private key."""
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as e:
        raise SecretError(f"{FILE_ENV}={path}: cannot read the secret file ({e.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(f"{FILE_ENV}={path}: the secret file is readable by others; run `chmod 600 {path}`")
    if not text:
        raise SecretError(f"{FILE_ENV}={path}: the secret file is empty")
    return text


def create(folder: Path) -> Path:
    """The run's secret file under `folder`: kept when it exists (a resumed run, or another node of
    the run that made it first), otherwise made with a fresh random secret, readable by its owner
    only from its first byte and complete when it appears (written aside, then linked in place)."""
    path = Path(folder) / FILE_NAME
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        aside = path.with_name(f"{FILE_NAME}.{os.getpid()}")
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        try:
            os.link(aside, path)
        except FileExistsError:
            pass  # another node of the run made it first: use theirs
        finally:
            aside.unlink()
    read(path)  # checks its permissions
    return path


def ensure(folder: Path) -> Path | None:
    """A process started by hand without a secret takes the run's: the file `FILE_NAME` in its
    output folder, made by the first of the run's processes to start (`create`: race-free, 0600)
    and read by the others, which share the folder. Its children inherit it. Nothing when a secret
    is given, or with `NO_SECRET_ENV` set (the explicit opt-out). Returns the file it took."""
    if value() is not None or os.environ.get(NO_SECRET_ENV, "").strip() not in ("", "0"):
        return None
    path = create(Path(folder).resolve())
    os.environ[FILE_ENV] = str(path)
    value.cache_clear()
    return path


def key(label: str) -> bytes | None:
    """A 32-byte key for one use of the secret (`label` names the use), None without a secret."""
    s = value()
    if s is None:
        return None
    return hmac.new(s.encode(), label.encode(), hashlib.sha256).digest()


def owner_token(run_dir: str) -> str:
    """The token that names a run as a LoRA adapter's owner on a shared server: keyed by the secret,
    so that nobody without it can name (and so unload, replace or list) the run's adapters. (Without
    a secret it is only a digest of the run folder: servers on loopback, where callers are trusted.)"""
    k = key("adapter-owner") or b"prime-rl-unkeyed"
    return hmac.new(k, str(run_dir).encode(), hashlib.sha256).hexdigest()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bound_host(argv: list[str], default: str) -> str:
    """The address a server given `argv` listens on: the last `--host` (vLLM's argparse takes the
    last one, so a `--host` in `extra_args` wins over ours), in either `--host X` or `--host=X`."""
    host = default
    for i, arg in enumerate(argv):
        if arg == "--host" and i + 1 < len(argv):
            host = argv[i + 1]
        elif arg.startswith("--host="):
            host = arg.split("=", 1)[1]
    return host


def require_for_bind(host: str, what: str, allow_unauthenticated: bool = False) -> None:
    """Refuse to listen beyond loopback without a secret: anyone on the network could then change
    what the server serves. One line naming the variables, and the opt-out."""
    if is_loopback(host) or value() is not None or allow_unauthenticated:
        return
    raise SecretError(
        f"{what} would listen on {host} without a run secret, so anyone who reaches it could change "
        f"the model it serves: set {ENV} or {FILE_ENV} (`rl` does this for you), bind 127.0.0.1, "
        f"or pass {OPT_OUT_FLAG} to accept that"
    )
