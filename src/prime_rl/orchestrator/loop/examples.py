"""Stream an env's examples in a seeded order, from a cursor the progress checkpoint saves.

Invariant: the taskset is read as a stream, never listed: at most `buffer` examples are held (a
shuffle buffer), and each epoch reads the taskset again from its start. The order is fixed by the
seed and the epoch, so a resumed run, which reads the epoch again up to its cursor, continues with
the same next example. A taskset no longer than the buffer is shuffled uniformly each epoch.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from prime_rl.environments import EnvError

T = TypeVar("T")


@dataclass
class Cursor:
    """Position in an env's example order: which epoch, and how far into it."""

    epoch: int = 0
    position: int = 0


def shuffled(items: Iterator[T], rng: random.Random, buffer: int) -> Iterator[T]:
    """`items` in an order drawn by `rng`, holding at most `buffer` of them: each new item takes the
    place of a random one of the held ones, which is yielded; the rest go out shuffled at the end."""
    held: list[T] = []
    for item in items:
        if len(held) < buffer:
            held.append(item)
            continue
        i = rng.randrange(buffer)
        yield held[i]
        held[i] = item
    rng.shuffle(held)
    yield from held


class ExampleSource:
    """Endless, seeded, epoch-shuffled stream of one env's examples (`examples` is iterated once
    per epoch)."""

    def __init__(
        self,
        examples: Iterable[T],
        seed: int,
        cursor: Cursor | None = None,
        buffer: int = 10_000,
        name: str = "env",
    ):
        self.examples = examples
        self.seed = seed
        self.buffer = buffer
        self.name = name
        self.epoch_size: int | None = None
        """Examples per epoch, once an epoch has been read to its end."""
        resume = cursor or Cursor()
        self.cursor = Cursor(resume.epoch, 0)
        self._stream = self._epoch(resume.epoch)
        for _ in range(resume.position):  # the same order again, up to where the last run was
            self.next()

    def _epoch(self, epoch: int) -> Iterator[T]:
        return shuffled(iter(self.examples), random.Random(f"{self.seed}-{epoch}"), self.buffer)

    def _read(self) -> T | None:
        try:
            return next(self._stream, None)
        except Exception as e:  # the taskset's own code failed while loading its next task
            raise EnvError(
                f"env '{self.name}': reading its next task failed (epoch {self.cursor.epoch}, task "
                f"{self.cursor.position}): {type(e).__name__}: {e}"
            ) from None

    def next(self) -> T:
        item = self._read()
        if item is None:
            if self.cursor.position == 0:
                raise EnvError(f"env '{self.name}': its taskset has no tasks")
            self.epoch_size = self.cursor.position
            self.cursor = Cursor(self.cursor.epoch + 1, 0)
            self._stream = self._epoch(self.cursor.epoch)
            item = self._read()
            if item is None:
                raise EnvError(f"env '{self.name}': its taskset has no tasks in epoch {self.cursor.epoch}")
        self.cursor.position += 1
        return item
