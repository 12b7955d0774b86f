"""Filesystem transport: one file per message, for debugging and for replaying a run's data.

Layout: `<dir>/step_<step>/rank_<rank>/<index>.msgpack` for micro-batches and
`<dir>/step_<step>/batch.msgpack` for whole training batches. Invariant: a file appears under
its final name only once it is complete (written to a temporary name, flushed, then renamed),
so a reader never sees half a message. With a run secret, each file ends with an HMAC-SHA-256 of its
place (step, rank, index) and its bytes (`seal`): a file someone else wrote, changed or moved is
refused, in one line naming it, before it is decoded, let alone trained on.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from pathlib import Path

from prime_rl.runtime import secret
from prime_rl.runtime.disk import writing
from prime_rl.transport.base import TransportError, TransportTimeout, check_run
from prime_rl.transport.messages import Message, MicroBatch, TrainingBatch, decode, encode


def message_path(root: Path, message: Message) -> Path:
    step_dir = root / f"step_{message.header.step:06d}"
    if isinstance(message, TrainingBatch):
        return step_dir / "batch.msgpack"
    return step_dir / f"rank_{message.header.rank}" / f"{message.index:04d}.msgpack"


SEAL_KEY = "file-transport"
TAG = 32


def _tag(key: bytes, place: str, data: bytes) -> bytes:
    return hmac.new(key, place.encode() + b"\n" + data, hashlib.sha256).digest()


def seal(root: Path, path: Path, data: bytes) -> bytes:
    """`data` as written at `path`: with a run secret, followed by its tag."""
    key = secret.key(SEAL_KEY)
    return data if key is None else data + _tag(key, str(path.relative_to(root)), data)


def unseal(root: Path, path: Path, data: bytes) -> bytes:
    """The message bytes of the file at `path`; `TransportError` when its tag is not the run's."""
    key = secret.key(SEAL_KEY)
    if key is None:
        return data
    body, tag = data[:-TAG], data[-TAG:]
    if len(data) < TAG or not hmac.compare_digest(tag, _tag(key, str(path.relative_to(root)), body)):
        raise TransportError(
            f"{path} is not sealed with this run's key: written, changed or moved by someone else "
            f"(or by a process without the run secret); it is not trained on"
        )
    return body


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` so that `path` is either absent or complete, never partial."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. a full disk: leave no partial file taking space
        raise


class FileSender:
    """Writes each message to its own file under `root`."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def send(self, message: Message) -> None:
        path = message_path(self.root, message)
        with writing(path, "a micro-batch for the trainer"):
            write_atomic(path, seal(self.root, path, encode(message)))

    def close(self) -> None:
        pass


class FileReceiver:
    """Reads one rank's micro-batches in order, step by step, starting at `start_step`."""

    def __init__(
        self,
        root: Path,
        run_id: str,
        rank: int = 0,
        start_step: int = 0,
        timeout_s: float = 600.0,
        poll_s: float = 0.01,
    ):
        self.root = Path(root)
        self.run_id = run_id
        self.rank = rank
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._step = start_step
        self._index = 0

    def _next_path(self) -> Path:
        return self.root / f"step_{self._step:06d}" / f"rank_{self.rank}" / f"{self._index:04d}.msgpack"

    def recv(self, timeout_s: float | None = None) -> Message:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        path = self._next_path()
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() >= deadline:
                raise TransportTimeout(
                    f"{path} did not appear within {timeout:.0f} s: is the orchestrator running?"
                )
            time.sleep(self.poll_s)
        message = check_run(decode(unseal(self.root, path, path.read_bytes())), self.run_id, str(path))
        if not isinstance(message, MicroBatch):
            raise TransportError(f"{path} holds a {type(message).__name__}, expected a MicroBatch")
        if message.index + 1 >= message.count:
            self._step, self._index = self._step + 1, 0
        else:
            self._index += 1
        return message

    def close(self) -> None:
        pass
