"""The config files a process is started with: `write_config` writes one with its secret-looking
values hidden (`redact.py`) and what they are beside it, and `config_args` says how to read both back.

Invariant: reading back what `write_config` wrote, with the arguments `config_args` returns, gives
the config that was written, and the file people look at never holds a secret-looking value.
"""

from __future__ import annotations

import os
from pathlib import Path

import tomli_w
from pydantic import BaseModel

from prime_rl.config.redact import redact, secret_part

SECRETS_SUFFIX = ".secrets.toml"
"""Beside a config written with `write_config`: what it hides, readable by its owner only."""


def secrets_path(path: Path) -> Path:
    return Path(path).with_suffix(SECRETS_SUFFIX)


def config_args(path: Path, config: BaseModel) -> list[str]:
    """The arguments that read back `config` as `write_config(path, config)` writes it: `@ path`, and
    `@ <path>.secrets.toml` when the config has secret-looking values."""
    hidden = secret_part(config.model_dump(mode="json", exclude_none=True)) is not None
    return ["@", str(path), *(["@", str(secrets_path(path))] if hidden else [])]


def write_config(path: Path, config: BaseModel) -> list[str]:
    """Write `config` for a process to read back (`config_args`, returned): `path` with its secret-
    looking values hidden, and what they are in `<path>.secrets.toml`, readable by its owner only, so
    that the folder can be shared and looked at. (A stale secrets file of an earlier run goes.)"""
    path, data = Path(path), config.model_dump(mode="json", exclude_none=True)
    path.write_text(tomli_w.dumps(redact(data)))
    private, hidden = secrets_path(path), secret_part(data)
    if hidden is None:
        private.unlink(missing_ok=True)
    else:
        fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # (an existing file keeps its mode through os.open)
        with os.fdopen(fd, "w") as f:
            f.write(tomli_w.dumps(hidden))
    return config_args(path, config)
