"""The settings `rl` shares between its processes, handed down from the top of its config.

Invariant: a shared setting (model, output dir, max steps, seq len, max async level) has one value in
all three processes. It is set once at the top level and handed down; a process section may repeat
it only with the same value, and conflicting explicit values are an error that names both keys.
This runs on the raw config, before validation, so that every process section is validated with the
values it will run with.
"""

from pathlib import Path
from typing import Any

from pydantic import TypeAdapter
from pydantic.fields import FieldInfo

SHARED: dict[str, list[tuple[str, ...]]] = {
    "model": [
        ("trainer", "model", "name"),
        ("orchestrator", "model", "name"),
        ("inference", "model", "name"),
    ],
    "output_dir": [("trainer", "output_dir"), ("orchestrator", "output_dir"), ("inference", "output_dir")],
    "max_steps": [("trainer", "max_steps"), ("orchestrator", "max_steps")],
    "seq_len": [("trainer", "seq_len"), ("orchestrator", "seq_len")],
    "max_async_level": [("orchestrator", "max_async_level")],
}
"""Each shared top-level field and the process fields it is handed down to."""


def hand_down(data: dict[str, Any], fields: dict[str, FieldInfo]) -> dict[str, Any]:
    """`data` (a raw `rl` config) with each shared value written into every process field it
    reaches; `fields` are the top-level fields (their types and defaults). A copy: `data` is kept."""
    data = _copy_tables(data)
    for key, targets in SHARED.items():
        adapter = TypeAdapter(fields[key].annotation)
        explicit: dict[str, Any] = {}
        if key in data:
            explicit[key] = data[key]
        for path in targets:
            found, value = _get(data, path)
            if found:
                explicit[".".join(path)] = value
        try:
            distinct = {repr(adapter.validate_python(v)) for v in explicit.values()}
        except ValueError:
            continue  # a malformed value: the field's own validation reports it by name
        if len(distinct) > 1:
            shown = ", ".join(f"{k} = {v!r}" for k, v in explicit.items())
            raise ValueError(
                f"conflicting values for the shared setting '{key}': {shown}. "
                f"Set it once, as the top-level '{key}'"
            )
        value = next(iter(explicit.values())) if explicit else fields[key].default
        data[key] = value
        for path in targets:
            _put(data, path, str(value) if isinstance(value, Path) else value)
    return data


def _copy_tables(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _copy_tables(v) if isinstance(v, dict) else v for k, v in data.items()}


def _get(data: dict[str, Any], path: tuple[str, ...]) -> tuple[bool, Any]:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return False, None
        data = data[key]
    return True, data


def _put(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        if not isinstance(data.get(key), dict):
            if key in data and data[key] is not None:
                return  # not a table: leave it for validation to report
            data[key] = {}
        data = data[key]
    data[path[-1]] = value
