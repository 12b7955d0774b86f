"""Turn a command line into a validated config.

Sources, lowest to highest precedence: the model's defaults, then TOML files given as `@ a.toml`
(several compose; later files win and tables deep-merge), then flags such as `--trainer.optim.lr 1e-5`,
`--flag` and `--no-flag`. `--help` lists every field with its docstring; `--dry-run` prints the
resolved config as TOML, its secret-looking values hidden (`redact.py`).

Invariant: a user mistake (missing or malformed file, unknown key, wrong type, or what a process's
start-up `check` finds) never produces a traceback. It becomes a `ConfigError` whose message names the key and where it came from, printed
as one paragraph, and the process exits with status 2.
"""

from __future__ import annotations

import difflib
import sys
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import tomli_w
from pydantic import BaseModel, ValidationError

from prime_rl.config.files import SECRETS_SUFFIX
from prime_rl.config.help import format_help
from prime_rl.config.redact import PLACEHOLDER, hidden_paths, is_secret_key, redact
from prime_rl.config.schema import (
    allows,
    fields_of,
    is_structured,
    item_members,
    leaf_paths,
    lookup,
    model_members,
)

EXIT_USAGE = 2
"""Exit status for a bad command line or config, as argparse and most Unix tools use."""

C = TypeVar("C", bound=BaseModel)


class ConfigError(Exception):
    """A mistake in the user's config or flags; its message is shown as is, without a traceback."""


def raise_problems(problems: Sequence[str | None]) -> None:
    """One `ConfigError` naming every problem found (each one sentence; None: no problem), so that a
    user fixes them all in one go; nothing when there are none."""
    found = [p for p in problems if p]
    if found:
        raise ConfigError(" ".join(p.rstrip(".") + "." for p in found))


@dataclass
class Sources:
    """The merged raw values and, for each key path, where its value came from."""

    values: dict[str, Any] = field(default_factory=dict)
    origin: dict[tuple[str, ...], str] = field(default_factory=dict)
    dry_run: bool = False
    help: bool = False

    def where(self, path: tuple[str, ...]) -> str:
        # A key set as part of a table inherits the table's origin.
        for n in range(len(path), 0, -1):
            if path[:n] in self.origin:
                return self.origin[path[:n]]
        # A section validated as a whole: name whatever set keys inside it.
        inside = sorted({v for k, v in self.origin.items() if k[: len(path)] == path})
        return ", ".join(inside) if inside else "defaults"


# --------------------------------------------------------------------------------------------------
# Sources.


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Tables merge key by key; any other value in `update` replaces the one in `base`."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _record_origin(sources: Sources, data: dict[str, Any], label: str, prefix: tuple[str, ...] = ()) -> None:
    for key, value in data.items():
        path = (*prefix, key)
        sources.origin[path] = label
        if isinstance(value, dict):
            _record_origin(sources, value, label, path)


def read_toml(path: Path) -> dict[str, Any]:
    """Read one TOML config file, turning I/O and syntax problems into a `ConfigError`."""
    if not path.is_file():
        hint = " (it is a directory)" if path.is_dir() else ""
        raise ConfigError(f"config file '{path}' not found{hint}.")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file '{path}' is not valid TOML: {e}.") from None
    except OSError as e:
        raise ConfigError(f"config file '{path}' cannot be read: {e.strerror}.") from None


def _set_path(data: dict[str, Any], path: Sequence[str], value: Any) -> None:
    for key in path[:-1]:
        nxt = data.get(key)
        if not isinstance(nxt, dict):
            nxt = {}
            data[key] = nxt
        data = nxt
    data[path[-1]] = value


def _parse_flag_value(cls: type[BaseModel], path: tuple[str, ...], raw: str, flag: str) -> Any:
    info = lookup(cls, path)
    if info is None:
        return raw  # reported as an unknown key later, with suggestions
    if raw.lower() in ("none", "null") and allows(info, type(None)):
        return None
    if is_structured(info):
        try:
            return tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            raise ConfigError(
                f'{flag} expects a TOML value such as [1, 2], ["a", "b"] or {{ key = 1 }}; got {raw!r}.'
            ) from None
    return raw  # pydantic converts strings to numbers, bools and paths


def collect_sources(cls: type[BaseModel], argv: Sequence[str]) -> Sources:
    """Merge the TOML files and flags of a command line, in order, into one raw dict."""
    sources = Sources()
    toml_layers: list[tuple[str, dict[str, Any]]] = []
    flag_values: dict[str, Any] = {}
    flag_origin: dict[tuple[str, ...], str] = {}
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg in ("-h", "--help"):
            sources.help = True
        elif arg == "--dry-run":
            sources.dry_run = True
        elif arg.startswith("@"):
            name = arg[1:]
            if not name:
                if i >= len(args):
                    raise ConfigError("'@' must be followed by a TOML file, as in '@ configs/rl.toml'.")
                name = args[i]
                i += 1
            path = Path(name)
            toml_layers.append((str(path), read_toml(path)))
        elif arg.startswith("--") and len(arg) > 2:
            key, eq, inline = arg[2:].partition("=")
            path = tuple(part.replace("-", "_") for part in key.split("."))
            if eq:
                value: Any = _parse_flag_value(cls, path, inline, f"--{key}")
            else:
                negated = _negated(cls, path)
                info = lookup(cls, path)
                takes_value = i < len(args) and not args[i].startswith(("--", "@"))
                if negated is not None:
                    path, value = negated, False
                elif info is not None and allows(info, bool) and not takes_value:
                    value = True
                elif takes_value:
                    value = _parse_flag_value(cls, path, args[i], f"--{key}")
                    i += 1
                elif info is None:
                    value = True  # an unknown key: reported by name, with a suggestion, at validation
                else:
                    raise ConfigError(f"--{key} needs a value, as in '--{key} VALUE'.")
            _set_path(flag_values, path, value)
            flag_origin[path] = f"--{'.'.join(path)}"
        else:
            raise ConfigError(
                f"unexpected argument {arg!r}: give TOML files as '@ file.toml' and settings as '--key value'."
            )
    for label, data in toml_layers:
        sources.values = deep_merge(sources.values, data)
        _record_origin(sources, data, label)
    sources.values = deep_merge(sources.values, flag_values)
    sources.origin.update(flag_origin)
    return sources


def _negated(cls: type[BaseModel], path: tuple[str, ...]) -> tuple[str, ...] | None:
    """For `--no-a.b` or `--a.no-b` naming a boolean field `a.b`, return `a.b`."""
    if lookup(cls, path) is not None:
        return None
    candidates = []
    if path[0].startswith("no_"):
        candidates.append((path[0][3:], *path[1:]))
    if path[-1].startswith("no_"):
        candidates.append((*path[:-1], path[-1][3:]))
    for cand in candidates:
        info = lookup(cls, cand)
        if info is not None and allows(info, bool):
            return cand
    return None


# --------------------------------------------------------------------------------------------------
# Validation and error messages.


def _dotted(path: Sequence[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _check_unknown_keys(cls: type[BaseModel], sources: Sources) -> None:
    """Reject keys that name no field, with the closest known key as a suggestion."""
    known = [".".join(p) for p, _ in leaf_paths(cls)]
    problems = []

    def walk(
        data: dict[str, Any], models: list[type[BaseModel]], prefix: tuple[Any, ...], in_list: bool
    ) -> None:
        fields = fields_of(models)
        for key, value in data.items():
            path = (*prefix, key)
            where = sources.where(tuple(p for p in path if isinstance(p, str)))
            moved = next((m.moved_keys[key] for m in models if key in getattr(m, "moved_keys", {})), None)
            if key not in fields and moved:
                problems.append(f"'{_dotted(path)}' (from {where}) is gone: {moved}.")
                continue
            if key not in fields:
                # Inside a list's item, only its siblings are suggested: a top-level key of the
                # same name is another setting.
                problems.append(_unknown_key_message(path, list(fields), [] if in_list else known, where))
                continue
            members = model_members(fields[key].annotation)
            if members and isinstance(value, dict):
                walk(value, members, path, in_list)
            items = item_members(fields[key].annotation)
            if items and isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, dict):
                        walk(item, items, (*path, i), True)

    walk(sources.values, [cls], (), False)
    if problems:
        raise ConfigError(" ".join(problems))


def _unknown_key_message(path: tuple[Any, ...], siblings: list[str], known: list[str], where: str) -> str:
    dotted = _dotted(path)
    close = difflib.get_close_matches(path[-1], siblings, n=1, cutoff=0.6)
    if close:
        hint = f" Did you mean '{_dotted((*path[:-1], close[0]))}'?"
    else:
        same_leaf = [k for k in known if k.rsplit(".", 1)[-1] == path[-1]]
        near = same_leaf or difflib.get_close_matches(dotted, known, n=1, cutoff=0.75)
        hint = f" Did you mean '{near[0]}'?" if near else ""
    section = _dotted(path[:-1]) or "the top level"
    return f"unknown key '{dotted}' (from {where}): there is no such setting in {section}.{hint}"


def _field_loc(cls: type[BaseModel], loc: Sequence[Any]) -> tuple[tuple[Any, ...], str | None]:
    """The error location without the tags pydantic inserts for the member of a union of sections
    (e.g. 'loss.ppo.clip_low' is the field 'loss.clip_low' of the member 'ppo'), and the last tag."""
    out, tag, models = [], None, [cls]
    for part in loc:
        if isinstance(part, str) and models and part not in fields_of(models):
            tag = part  # a union member's tag, not a field
            continue
        out.append(part)
        if isinstance(part, str):  # (an index keeps the models: a list's items are its field's)
            info = fields_of(models).get(part) if models else None
            models = (model_members(info.annotation) or item_members(info.annotation)) if info else []
    return tuple(out), tag


def _validation_message(cls: type[BaseModel], err: ValidationError, sources: Sources) -> str:
    lines = []
    seen = set()  # a shared setting handed down to several sections fails once per section
    for e in err.errors(include_url=False):
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        loc, tag = _field_loc(cls, loc)
        if e["type"] == "extra_forbidden" and tag is not None:
            e = {**e, "msg": f"not a setting of type = {tag!r}"}
        dotted = _dotted(loc)
        str_path = tuple(p for p in loc if isinstance(p, str))
        where = sources.where(str_path) if loc else "the config"
        msg = e["msg"].removeprefix("Value error, ").rstrip(".")
        if e["type"] == "missing":
            lines.append(f"'{dotted}' is required but not set.")
        elif not loc:
            lines.append(f"{msg}.")
        else:
            value = e.get("input")
            if (msg, repr(value)) in seen:
                continue
            seen.add((msg, repr(value)))
            hide = isinstance(value, dict) or any(is_secret_key(p) for p in str_path)
            shown = "" if hide else f" = {value!r}"
            lines.append(f"'{dotted}'{shown} (from {where}): {msg}.")
    return " ".join(lines)


def build_config(cls: type[C], sources: Sources) -> C:
    """Validate merged sources into `cls`, or raise a `ConfigError` that names the key."""
    _check_unknown_keys(cls, sources)
    _check_redacted(sources)
    try:
        return cls(**sources.values)
    except ValidationError as e:
        raise ConfigError(_validation_message(cls, e, sources)) from None


def _check_redacted(sources: Sources) -> None:
    """Refuse a hidden value read back as if it were the real one (a written config, `write_config`,
    read without the file that holds what it hides): it would fail far later, as a refused API key."""
    paths = hidden_paths(sources.values)
    if paths:
        where = sources.where(tuple(p for p in paths[0] if isinstance(p, str)))
        raise ConfigError(
            f"'{_dotted(paths[0])}' (from {where}) is {PLACEHOLDER!r}, a value hidden when its config was "
            f"written: add the file written beside it ('@ <name>{SECRETS_SUFFIX}'), or set the real value."
        )


# --------------------------------------------------------------------------------------------------
# Output: --help and --dry-run (the config files a process is started with: files.py).


def to_toml(config: BaseModel, redacted: bool = False) -> str:
    """The config as TOML that, read back with `@`, gives the same config; `redacted`: with its
    secret-looking values hidden (`redact.py`), for people to read."""
    data = config.model_dump(mode="json", exclude_none=True)
    return tomli_w.dumps(redact(data) if redacted else data)


# --------------------------------------------------------------------------------------------------
# Entry point used by every console script.


def parse_config(
    cls: type[C],
    argv: Sequence[str] | None = None,
    prog: str | None = None,
    check: Callable[[C], None] | None = None,
    dry_run: Callable[[C], str] | None = None,
    commands: str = "",
) -> C:
    """Parse `argv` into `cls`. Handles --help and --dry-run (print, exit 0) and user errors (exit 2).

    `check` runs on the validated config (also for --dry-run); a `ConfigError` it raises is a user
    error like any other (the checks that import user code are each process's `preflight.py`).
    `dry_run` says what --dry-run prints (default: the resolved config as TOML, secrets hidden);
    `commands` adds lines to --help about the program's own flags."""
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = prog or Path(sys.argv[0]).name
    try:
        sources = collect_sources(cls, argv)
        if sources.help:
            sys.stdout.write(format_help(cls, prog, commands))
            raise SystemExit(0)
        config = build_config(cls, sources)
        if check is not None:
            check(config)
    except ConfigError as e:
        sys.stderr.write(f"{prog}: error: {e}\nRun '{prog} --help' to list the settings.\n")
        raise SystemExit(EXIT_USAGE) from None
    if sources.dry_run:
        sys.stdout.write(dry_run(config) if dry_run is not None else to_toml(config, redacted=True))
        raise SystemExit(0)
    return config
