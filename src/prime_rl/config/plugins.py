"""One pattern for every pluggable function (advantage functions, token estimators, losses, reward
functions): a registry of built-ins by name, and a dotted import path for the user's own.

A config section picks one with `type`: a built-in's name, or 'package.module:function'. A built-in
is a function and its config (a `BaseConfig` whose `type` is `Literal[name]`, a docstring under
every field), listed once in its kind's registry. Where they live depends on the kind: an advantage
or reward function shares one module with its config (`orchestrator/advantages/grpo.py`), while a
loss or token estimator has a module of its own for the function (`trainer/losses/cpgd.py`) and its
config in the kind's `config.py`, whose registry names the function by import path, so that configs
load no torch. A built-in's own fields reach the function as keyword arguments; the user's own
function gets the `kwargs` table. Fields that every member of a kind shares live in the kind's base
config and are read by the caller, not passed.

Invariant: a path that does not resolve to a callable raises `PluginError` whose message names the
config key, the path and what is wrong, never an ImportError traceback.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Union

from pydantic import Discriminator, Tag

from prime_rl.config import BaseConfig

CUSTOM = "custom"
"""The tag of a user's function in a registry's config union."""


class PluginError(ValueError):
    """User code named in a config could not be loaded."""


def is_import_path(name: str) -> bool:
    return ":" in name or "." in name


def load_function(import_path: str, key: str) -> Callable[..., Any]:
    """Resolve 'package.module:function' (or 'package.module.function'); errors name it as `key`."""
    where = f"{key} = {import_path!r}"
    module_name, sep, attr = import_path.partition(":")
    if not sep:
        module_name, _, attr = import_path.rpartition(".")
    if not module_name or not attr:
        raise PluginError(f"{where} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PluginError(f"{where}: cannot import '{module_name}': {e}") from None
    except Exception as e:  # the module's own code failed while it was imported
        raise PluginError(f"{where}: importing '{module_name}' raised {type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise PluginError(f"{where}: '{module_name}' has no function '{attr}'")
    return fn


def plugin_problem(key: str, config: Any) -> str | None:
    """Why the user's function that the plugin section `key` names (`type` = an import path) cannot
    load, for a process's preflight; None when it loads, or for a built-in (its config validated it)."""
    if not is_import_path(config.type):
        return None
    try:
        load_function(config.type, key=f"{key}.type")
    except PluginError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class Builtin:
    """A built-in: its name (the `type` that selects it), its function and its config."""

    name: str
    fn: Callable[..., Any] | str
    """The function, or where it lives ('package.module:function'), imported when it is resolved:
    a kind whose functions need heavy imports (torch) keeps its configs light this way."""
    config: type[BaseConfig]


@dataclass(frozen=True)
class Resolved:
    """A configured function, ready to call as `fn(inputs, **kwargs)`."""

    name: str
    """The built-in's name or the user's import path (for error messages)."""
    fn: Callable[..., Any]
    kwargs: dict[str, Any]


class Registry:
    """The built-ins of one kind, and how a config of that kind resolves to a function."""

    def __init__(
        self, kind: str, base: type[BaseConfig], custom: type[BaseConfig], builtins: Sequence[Builtin]
    ):
        self.kind = kind
        self.base = base
        """Fields every member shares (not passed to the function)."""
        self.custom = custom
        """The config of a user's function: `type` (its import path) and `kwargs`."""
        self.builtins = {b.name: b for b in builtins}

    @property
    def names(self) -> list[str]:
        return list(self.builtins)

    def tag(self, value: Any) -> str | None:
        """Which member of the config union a raw table (or a config) is."""
        name = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        if name is None and isinstance(value, dict):
            return next(iter(self.builtins))  # the kind's default, as the config's default says
        if not isinstance(name, str):
            return None
        return CUSTOM if is_import_path(name) else name if name in self.builtins else None

    def config_type(self) -> Any:
        """The annotation of a config field that selects one member of this kind."""
        members = [Annotated[b.config, Tag(b.name)] for b in self.builtins.values()]
        members.append(Annotated[self.custom, Tag(CUSTOM)])
        choices = ", ".join(f"'{n}'" for n in self.builtins)
        return Annotated[
            Union[tuple(members)],  # noqa: UP007 (a runtime-built union)
            Discriminator(
                self.tag,
                custom_error_type="unknown_plugin",
                custom_error_message=f"'type' must name a built-in {self.kind} ({choices}) or your "
                "own function as 'package.module:function'",
            ),
        ]

    def resolve(self, config: BaseConfig, key: str) -> Resolved:
        """The function a validated config selects; a user's is imported here (`key` names the
        config section in errors, e.g. 'trainer.loss')."""
        name = config.type  # type: ignore[attr-defined]
        if isinstance(config, self.custom):
            return Resolved(name, load_function(name, key=f"{key}.type"), dict(config.kwargs))  # type: ignore[attr-defined]
        shared = set(self.base.model_fields) | {"type"}
        kwargs = {k: getattr(config, k) for k in type(config).model_fields if k not in shared}
        fn = self.builtins[name].fn
        return Resolved(name, fn if callable(fn) else load_function(fn, key=f"{key}.type"), kwargs)


def lazy_names(package: str, lazy: dict[str, tuple[str, ...]]) -> Callable[[str], Any]:
    """The `__getattr__` of a kind's package, which loads each name of `lazy` (module -> names) from
    its module on first use: the package then holds its config and registry without loading torch.
    The package keeps `lazy` as a literal named `LAZY`, which tests/unit/layering_test.py reads as
    the imports of whoever takes those names from the package."""
    home = {name: module for module, names in lazy.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name in home:
            return getattr(importlib.import_module(home[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
