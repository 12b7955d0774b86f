"""Stream an env's examples in a seeded order, from a cursor the progress checkpoint saves.

Invariant: examples are drawn without holding the dataset in Python memory (rows are read one at a
time from the Arrow-backed dataset), in an order fixed by the seed and the epoch, so a resumed run
continues with the same next example.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any


@dataclass
class Cursor:
    """Position in an env's example order: which epoch, and how far into it."""

    epoch: int = 0
    position: int = 0


class ExampleSource:
    """Endless, seeded, epoch-shuffled stream of one dataset's rows."""

    def __init__(self, dataset, seed: int, cursor: Cursor | None = None):
        self.dataset = dataset
        self.seed = seed
        self.cursor = cursor or Cursor()
        self._order = self._permutation(self.cursor.epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def next_indexed(self) -> tuple[int, dict[str, Any]]:
        """The next example: its index in the dataset, and its row."""
        if self.cursor.position >= len(self._order):
            self.cursor = Cursor(self.cursor.epoch + 1, 0)
            self._order = self._permutation(self.cursor.epoch)
        index = self._order[self.cursor.position]
        self.cursor.position += 1
        return index, self.dataset[index]

    def next(self) -> dict[str, Any]:
        return self.next_indexed()[1]
