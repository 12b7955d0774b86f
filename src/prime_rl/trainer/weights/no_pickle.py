"""Loading a checkpoint without running code from it.

A pickle may call any function it names, so a checkpoint folder that someone else can write (a
shared filesystem) would run their code when a trainer resumes. torch.distributed.checkpoint reads
its `.metadata` with plain `pickle.load` and its non-tensor items with `torch.load(weights_only=False)`;
here the metadata is read by an unpickler that knows only checkpoint metadata, and every other
payload with `weights_only=True` (tensors and plain containers only).

Invariant: nothing in a checkpoint folder is unpickled except through `NoCode` or `torch.load(...,
weights_only=True)`; a payload naming anything else raises `NotState` (a `pickle.UnpicklingError`)
before it runs.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # what the base planner uses
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}  # fmt: skip
"""What DCP's metadata names: its dataclasses and enums, torch's sizes, dtypes and layouts, paths."""


NOT_STATE = "which checkpoint state never holds"


class NotState(pickle.UnpicklingError):
    """A payload refused because it names a global that checkpoint state never holds (`named`: that
    global, None where the refusal did not say), before anything it names was called."""

    def __init__(self, named: str | None):
        self.named = named
        super().__init__(f"it names {named or 'a global'}, {NOT_STATE}")


class NoCode(pickle.Unpickler):
    """Unpickles checkpoint metadata; refuses every other global (so no function can be called)."""

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if "." not in name and (name in ALLOWED.get(module, ()) or is_dtype):
            return super().find_class(module, name)
        raise NotState(f"{module}.{name}")


def load_weights_only(f) -> Any:
    """`torch.load(f, weights_only=True)` (`f`: a path or a file), its refusal raised as `NotState`.
    Whether a payload is refused is torch's decision; its message only supplies the global named."""
    try:
        return torch.load(f, weights_only=True)
    except pickle.UnpicklingError as e:
        named = re.search(r"GLOBAL ([\w.]+)", str(e))
        raise NotState(named.group(1) if named else None) from e


class SafeReader(FileSystemReader):
    """DCP's file reader, with its metadata read by `NoCode`. DCP reports a failed metadata read as
    an AssertionError of its own, with the cause in its text only: `refused` keeps the refusal."""

    refused: NotState | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = NoCode(f).load()
            except NotState as e:
                self.refused = e
                raise
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(
                f"its .metadata holds a {type(metadata).__name__}, not DCP's Metadata"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, with its non-tensor items (optimizer settings, say) loaded weights-only:
    the base class's `load_bytes`, but for `weights_only`; `refused` keeps a refusal."""

    refused: NotState | None = None

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = load_weights_only(value)
        except NotState as e:
            self.refused = e
            raise
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
