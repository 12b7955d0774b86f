"""Runs that share an inference server are its tenants: each signs its requests with a tenant key
that the server's owner issued to it, and reaches only its own adapters and requests.

A tenant key is `HMAC(key("tenants"), name)` under the *server's* secret: the owner issues one with
`uv run tenant-key NAME FILE` (a 0600 file `NAME HEXKEY`), the server recomputes it from the name a
request is signed with, and keeps no list. The run names the file in `PRIME_RL_TENANT_KEY_FILE`;
its own secret (its transport, checkpoints, the rest of its run) stays its own, so another tenant
can compute none of its keys.

Invariants: a tenant key opens nothing but its tenant's requests; no tenant key is the owner's or
the orchestrator's (those ids are reserved); a key file others may read is refused, as the run
secret's is.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import hmac
import os
import re
import sys
from pathlib import Path

from prime_rl.runtime import secret

ENV = "PRIME_RL_TENANT_KEY_FILE"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
RESERVED = frozenset({"", "orchestrator"})


def valid(name: str) -> bool:
    return name not in RESERVED and NAME.fullmatch(name) is not None


def key_for(name: str) -> bytes | None:
    """Tenant `name`'s request key under this process's (the server's) secret."""
    root = secret.key("tenants")
    if root is None or not valid(name):
        return None
    return hmac.new(root, name.encode(), hashlib.sha256).digest()


@functools.cache
def mine() -> tuple[str, bytes] | None:
    """This process's tenant name and key (`PRIME_RL_TENANT_KEY_FILE`), None when it is no tenant."""
    path = os.environ.get(ENV, "").strip()
    if not path:
        return None
    text = secret.read(Path(path))  # (refused, one line, when others may read it)
    name, _, hexkey = text.partition(" ")
    try:
        key = bytes.fromhex(hexkey.strip())
    except ValueError:
        key = b""
    if not valid(name) or len(key) != 32:
        raise secret.SecretError(f"{ENV}={path}: not a tenant key file (`NAME HEXKEY`, from `tenant-key`)")
    return name, key


def issue(name: str, path: Path) -> Path:
    """Write tenant `name`'s key file (0600 from its first byte)."""
    key = key_for(name)
    if key is None:
        raise secret.SecretError(
            f"cannot issue a key for {name!r}: "
            + ("set the server's secret (PRIME_RL_SECRET_FILE)" if secret.key("tenants") is None
               else "a name is 1-64 letters, digits, '_', '.', '-' (not 'orchestrator')")
        )  # fmt: skip
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{name} {key.hex()}\n")
    os.chmod(path, 0o600)
    return path


def main(argv: list[str] | None = None) -> None:
    """`uv run tenant-key NAME FILE`: run by a shared server's owner, with the server's secret."""
    parser = argparse.ArgumentParser(
        prog="tenant-key",
        description="Issue a tenant key for a run that shares this inference server (needs the server's "
        "secret in PRIME_RL_SECRET_FILE). Give the file to the run as PRIME_RL_TENANT_KEY_FILE.",
    )
    parser.add_argument("name", help="the tenant's name (its adapters and requests are its own)")
    parser.add_argument("file", type=Path, help="where to write the key (0600)")
    args = parser.parse_args(argv)
    try:
        path = issue(args.name, args.file)
    except (secret.SecretError, OSError) as e:
        sys.stderr.write(f"tenant-key: error: {e}\n")
        raise SystemExit(2) from None
    print(f"tenant {args.name!r}: key written to {path}; the run sets {ENV}={path.resolve()}")
