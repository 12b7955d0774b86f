"""Check a model name that points at a local folder before any process starts loading it.

A name is taken as local when it starts with '/', '.' or '~', has more than one '/', or exists:
hub ids are 'name' or 'org/name'. Only local names are checked; a hub id is left to the loader.
"""

from __future__ import annotations

from pathlib import Path


def check_model_name(name: str) -> str:
    """Return `name`, or raise ValueError saying what is wrong with the local folder it names."""
    path = Path(name).expanduser()
    local = name.startswith(("/", ".", "~")) or name.count("/") > 1 or path.exists()
    if not local:
        return name
    if not path.is_dir():
        raise ValueError(
            f"no model folder at '{name}' (resolved: {path.resolve()}); give a local HF folder "
            "(config.json, safetensors weights, tokenizer), e.g. one made by `make-tiny-model`"
        )
    if not (path / "config.json").exists():
        raise ValueError(f"'{name}' is a folder but not an HF model: it has no config.json")
    return name
