"""Secret-looking values of a config, hidden wherever the config is written for people to read or
sent away (the process configs `rl` writes, the SLURM job's config, W&B's run config, --dry-run).

The rule (`is_secret_key`): a key is secret-looking when its last word names a secret. The key is
split into words at `_`, `-`, `.`, spaces and lowerCamel humps and lower-cased; its last word is
what the value is (`api_key` is a key, `key_dim` a dimension, `max_tokens` a count). The words are
key(s), token, secret(s), password(s), passwd, credential(s), apikey, bearer, auth, authorization,
cookie(s), header(s), passphrase, jwt, sessionid; a last word ending in password, passwd or
passphrase (`PGPASSWORD`); and `session_id`. So `api_key`, `OPENAI_API_KEY`, `hf_token`, `access_token`, `apiKey`,
`password`, `client_secret`, `headers`, `extra_headers`, `Authorization` and `X-Api-Key` are
redacted, and `max_tokens`, `max_new_tokens`, `num_tokens`, `tokenizer`, `key_dim`,
`api_key_file`, `token_budget` and `seq_len` are not. ("tokens" is left out on purpose: it counts.)
Some harmless values are hidden too (`answer_key = "answer"`): a wrongly hidden value costs a look
at the run's own config, a wrongly shown one a leaked key. A secret under a key that does not say so
(`args = {judge = "sk-..."}`, a URL with a password in it) is not found.

Invariants: nothing here changes its input; values that are None or a bool are never hidden (they
say whether, not what); and `deep_merge(redact(d), secret_part(d)) == d` (`config.cli.deep_merge`),
which is how a process gets back what its written config hides.
"""

from __future__ import annotations

import re
from typing import Any

PLACEHOLDER = "***"
"""What a hidden value is written as."""

WORDS = frozenset(
    {
        "key", "keys", "token", "secret", "secrets", "password", "passwords", "passwd", "credential",
        "credentials", "apikey", "bearer", "auth", "authorization", "cookie", "cookies", "header",
        "headers", "passphrase", "jwt", "sessionid",
    }
)  # fmt: skip
"""Last words of secret-looking keys."""

SUFFIXES = ("password", "passwd", "passphrase")
"""A last word ending so is secret-looking too (`PGPASSWORD`, `dbpasswd`)."""

_HUMP = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")  # apiKey, HFToken


def is_secret_key(key: Any) -> bool:
    """Whether values under `key` are hidden (the rule is the module's docstring)."""
    if not isinstance(key, str):
        return False
    words = re.split(r"[_\-.\s]+", _HUMP.sub("_", key).lower())
    words = [w for w in words if w]
    last = words[-1] if words else ""
    return last in WORDS or last.endswith(SUFFIXES) or words[-2:] == ["session", "id"]


def _hidden(key: Any, value: Any) -> bool:
    return is_secret_key(key) and value is not None and not isinstance(value, bool)


def redact(data: Any) -> Any:
    """A copy of `data` (dicts, lists, scalars) with every secret-looking value, at any depth, replaced
    by `PLACEHOLDER` (a dict or list under such a key as a whole)."""
    if isinstance(data, dict):
        return {k: PLACEHOLDER if _hidden(k, v) else redact(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [redact(v) for v in data]
    return data


def secret_part(data: Any) -> Any:
    """What `redact(data)` hides, as the least of `data` that, deep-merged over it, restores it: in a
    dict the secret-looking keys and the keys holding one; a list holding one whole (a merge replaces
    a list, it does not merge it). None when nothing is hidden."""
    if isinstance(data, dict):
        part = {}
        for k, v in data.items():
            if _hidden(k, v):
                part[k] = v
            elif (inner := secret_part(v)) is not None:
                part[k] = inner
        return part or None
    if isinstance(data, list | tuple):
        return list(data) if any(secret_part(v) is not None for v in data) else None
    return None


def hidden_paths(data: Any, prefix: tuple = ()) -> list[tuple]:
    """The paths (keys and list indices) of the secret-looking values that are `PLACEHOLDER`: values
    read back from a redacted file, which a process must not take for the real ones."""
    found = []
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for k, v in items:
        if isinstance(data, dict) and v == PLACEHOLDER and is_secret_key(k):
            found.append((*prefix, k))
        else:
            found += hidden_paths(v, (*prefix, k))
    return found
