"""`--help`: every field of a config with its docstring, type and default."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from prime_rl.config.schema import allows, is_model, item_members, leaf_paths, model_members, unwrap


def _type_name(info: Any) -> str:
    names = []
    for tp in unwrap(info.annotation):
        if tp is type(None):
            continue
        origin = typing.get_origin(tp)
        if origin is typing.Literal:
            names.append("|".join(str(a) for a in typing.get_args(tp)))
        else:
            name = getattr(origin or tp, "__name__", str(tp))
            names.append(
                {"str": "STR", "int": "INT", "float": "FLOAT", "bool": "BOOL"}.get(name, name.upper())
            )
    return " | ".join(names) or "VALUE"


def format_help(cls: type[BaseModel], prog: str, commands: str = "") -> str:
    """`commands`: lines about flags of the program's own (not config), shown under the usage."""
    doc = (cls.__doc__ or "").strip()
    lines = [
        f"usage: {prog} [@ config.toml ...] [--key value ...] [--dry-run] [--help]",
        "",
        doc,
        "",
        "TOML files compose left to right (later wins, tables deep-merge); flags override files.",
        "Booleans: --key / --no-key. Lists and tables: --key '[1, 2]'. --dry-run prints the resolved config.",
        *([commands] if commands else []),
        "",
    ]
    lines += _field_lines(leaf_paths(cls), flags=True)
    return "\n".join(lines) + "\n"


def _field_lines(paths, flags: bool, prefix: str = "") -> list[str]:
    """`flags`: settable as `--a.b`; else a key of a list's items (`envs[].id`), set in TOML only."""
    lines = []
    for path, info in paths:
        dotted = prefix + ".".join(path)
        desc = (info.description or "").strip()
        if model_members(info.annotation) and not _is_structured_leaf(info):
            lines.append(f"[{dotted}]  {desc}")
            continue
        flag = f"--{dotted}" if flags else f"  {dotted}"
        if flags and allows(info, bool):
            flag += f" / --no-{dotted}"
        else:
            flag += f" {_type_name(info)}"
        default = info.get_default(call_default_factory=True)
        if info.is_required():
            shown = " [required]"
        else:
            shown = "" if default is None or is_model(type(default)) else f" [default: {_show(default)}]"
        lines.append(f"  {flag}\n      {desc}{shown}")
        items = item_members(info.annotation)
        if items:
            # The keys of each item (e.g. an env's `rewards` and their built-ins) have no flags:
            # list them so that --help still names every setting and every built-in.
            doc = f": {(items[0].__doc__ or '').strip()}" if len(items) == 1 else " (its `type` picks one)"
            lines.append(f"[[{dotted}]]  each item of {dotted}{doc}")
            lines += _field_lines(leaf_paths(items), flags=False, prefix=f"{dotted}[].")
    return lines


def _is_structured_leaf(info: Any) -> bool:
    return any(typing.get_origin(tp) in (list, dict, tuple) for tp in unwrap(info.annotation))


def _show(value: Any) -> str:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, BaseModel):
        return str(value.model_dump(mode="json"))
    return repr(value)
