"""Walking a config's schema: which keys exist under a model (or a union of models, such as a
plugin's built-ins), and what type each leaf has. Used by the parser and by --help."""

from __future__ import annotations

import copy
import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel


def unwrap(annotation: Any) -> list[Any]:
    """The concrete types an annotation may take (Optional, Union and Annotated removed)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        out = []
        for arg in typing.get_args(annotation):
            out.extend(unwrap(arg))
        return out
    return [annotation]


def is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def model_members(annotation: Any) -> list[type[BaseModel]]:
    return [tp for tp in unwrap(annotation) if is_model(tp)]


def item_members(annotation: Any) -> list[type[BaseModel]]:
    """The models an item of a list field may be (e.g. `envs`: [EnvConfig]); [] for other fields."""
    out = []
    for tp in unwrap(annotation):
        if typing.get_origin(tp) is list:
            out += [item for arg in typing.get_args(tp) for item in unwrap(arg) if is_model(item)]
    return out


def fields_of(models: Sequence[type[BaseModel]]) -> dict[str, Any]:
    """Field name -> FieldInfo over one model, or over every member of a union of models (whose
    `type` then takes any member's value: a plugin registry's built-ins or an import path)."""
    out: dict[str, Any] = {}
    for model in models:
        for name, info in model.model_fields.items():
            out.setdefault(name, info)
    if len(models) > 1 and "type" in out:
        kinds = [m.model_fields["type"].annotation for m in models if "type" in m.model_fields]
        if len(kinds) > 1:
            merged = copy.copy(out["type"])
            merged.annotation = typing.Union[tuple(kinds)]  # noqa: UP007 (built at run time)
            merged.description = "Selects a built-in by name" + (
                ", or your own function as 'package.module:function'." if str in kinds else "."
            )
            out = {"type": merged, **{k: v for k, v in out.items() if k != "type"}}  # first in --help
    return out


def lookup(cls: type[BaseModel], path: Sequence[str]) -> Any | None:
    """The FieldInfo at a dotted path, or None if no such field exists."""
    models: list[type[BaseModel]] = [cls]
    info = None
    for i, key in enumerate(path):
        fields = fields_of(models)
        if key not in fields:
            return None
        info = fields[key]
        models = model_members(info.annotation)
        if not models and i < len(path) - 1:
            return None
    return info


def leaf_paths(cls: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every field path under a model, depth first, sections included."""
    out = []
    for name, info in fields_of([cls] if is_model(cls) else cls).items():
        path = (*prefix, name)
        out.append((path, info))
        members = model_members(info.annotation)
        if members:
            out.extend(leaf_paths(members, path))  # type: ignore[arg-type]
    return out


def allows(info: Any, kind: type) -> bool:
    return any(tp is kind for tp in unwrap(info.annotation))


def is_structured(info: Any) -> bool:
    """Whether a CLI value for this field must be written as a TOML value (list, table)."""
    for tp in unwrap(info.annotation):
        origin = typing.get_origin(tp) or tp
        if origin in (list, tuple, dict, set) or is_model(origin):
            return True
    return False
