"""Refusals logged without letting a flood of bad requests flood the log.

Invariant: the first refusal is logged at once; after it, at most one line per `every_s` seconds,
which counts the refusals it stands for. Thread-safe (servers refuse from many threads).
"""

from __future__ import annotations

import logging
import threading
import time


class RateLimited:
    def __init__(self, log: logging.Logger, every_s: float = 10.0):
        self.log, self.every_s = log, every_s
        self._unsaid = 0
        self._last: float | None = None
        self._lock = threading.Lock()

    def say(self, line: str) -> None:
        with self._lock:
            self._unsaid += 1
            now = time.monotonic()
            if self._last is not None and now - self._last < self.every_s:
                return
            more, self._unsaid, self._last = self._unsaid - 1, 0, now
        self.log.warning("%s%s", line, f" (and {more} more since the last line)" if more else "")
