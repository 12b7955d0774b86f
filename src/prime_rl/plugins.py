"""Load user code named by import path in a config (custom advantage functions, losses).

Invariant: a path that does not resolve to a callable raises `PluginError` whose message names the
config key, the path and what is wrong, never an ImportError traceback.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class PluginError(ValueError):
    """User code named in a config could not be loaded."""


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
