"""How a process of a run stops on Ctrl-C (SIGINT) or SIGTERM: promptly, with one line, no traceback.

Invariant: once `take_signals` ran, the first SIGINT or SIGTERM ends the process within GRACE_S
seconds, with exit status 128 + the signal (what a shell reports for a process a signal killed)
after one line, `<time> <process> stopped by SIGINT`. In the main thread the signal raises `Stopped`,
so that the process's own cleanup runs (files closed, children stopped). If that has not ended the
process by the deadline, or the main thread cannot run Python at all (blocked in a collective, a
long kernel or a C library that retries its wait), the process ends there and then, with the same
line. Later signals change nothing: the stop is under way, and bounded.

The handlers are installed whatever the process inherited: a shell without job control starts a
background command with SIGINT ignored, and `kill -INT` then did nothing at all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

GRACE_S = 5.0
"""How long a process's own cleanup may take after the first signal."""

SIGNALS = (signal.SIGINT, signal.SIGTERM)

log = logging.getLogger("prime_rl")


class Stopped(BaseException):
    """The first SIGINT or SIGTERM, raised in the main thread. A BaseException, like
    KeyboardInterrupt, so that no `except Exception` takes the stop for an error."""

    def __init__(self, sig: signal.Signals):
        super().__init__(f"stopped by {sig.name}")
        self.sig = sig

    @property
    def status(self) -> int:
        return 128 + self.sig


class _State:
    lock = threading.RLock()  # re-entered when a second signal's handler runs while the main thread holds it
    sig: signal.Signals | None = None
    raised = False
    said = False
    announce = True
    grace_s = GRACE_S
    watching = False
    last_actions: list[Callable[[], None]] = []


def stopping() -> signal.Signals | None:
    """The signal this process is stopping for, None while it is not stopping."""
    return _State.sig


def take_signals(announce: bool = True, grace_s: float = GRACE_S) -> None:
    """From now on SIGINT and SIGTERM stop this process (module docstring). `announce`: whether this
    process says the line (a trainer rank other than the first stays quiet: the run says it once).
    Call from the main thread; elsewhere (a test running a loop in a thread) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    _State.announce, _State.grace_s = announce, grace_s
    if not _State.watching:  # a second call (the entry point's, then the process's main) keeps the watcher
        _State.watching = True
        # Python's C-level handler writes each signal's number to this pipe as it arrives, in
        # whichever thread it arrives, even while the main thread is stuck in native code: the
        # watcher arms the deadline from it.
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=_watch, args=(read_fd,), daemon=True, name="stop-watch").start()
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)


def _forget_in_child() -> None:
    # A forked child (vLLM's engine core, forked from the orchestrator) inherits the wakeup pipe:
    # a signal it takes (vLLM stops its processes with SIGTERM) would write to its parent's watcher,
    # which took it for its own and stopped the parent. The child has no watcher: it stops as it will.
    if _State.watching:
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)
        _State.watching = False


os.register_at_fork(after_in_child=_forget_in_child)


def arm(sig: signal.Signals) -> None:
    """Record the stop for `sig` and end the process the grace period from now unless it has ended
    by then (the first call counts). For a process that also takes signals its own way (the
    orchestrator's event loop)."""
    with _State.lock:
        if _State.sig is not None:
            return
        _State.sig = sig
    timer = threading.Timer(_State.grace_s, _deadline)
    timer.daemon = True
    timer.start()


def at_deadline(action: Callable[[], None]) -> None:
    """Run `action` before the process is ended at the deadline (e.g. kill what it started)."""
    _State.last_actions.append(action)


def say_stopped() -> None:
    """The process's one line about the stop (said once, and only if this process announces). A
    stop no handler here recorded is a KeyboardInterrupt from a handler a library installed: SIGINT."""
    with _State.lock:
        if _State.said:
            return
        _State.said = True
        _State.sig = _State.sig or signal.SIGINT
    if _State.announce:
        log.info("stopped by %s", _State.sig.name)


def exit_stopped() -> NoReturn:
    """Say the line and leave with 128 + the signal (call once the process's cleanup is done)."""
    say_stopped()
    raise SystemExit(128 + _State.sig)


def exit_now(code: int) -> NoReturn:
    """End the process at once, logs and output flushed, skipping interpreter finalization (see
    `trainer.dist.exit_rank`; the fake-GPU dry run needs it too: its device's autograd worker thread
    can be torn down while the interpreter shuts down, which aborts the process after a passing run)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _on_signal(signum: int, frame) -> None:
    sig = signal.Signals(signum)
    arm(sig)
    if not _State.raised:  # a second signal (uv and the shell may both forward a Ctrl-C) is ignored
        _State.raised = True
        raise Stopped(sig)


def _watch(read_fd: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 1)
        except OSError:
            return
        if not data:
            return
        if data[0] in SIGNALS:
            arm(signal.Signals(data[0]))


def _deadline() -> None:
    for action in _State.last_actions:
        with contextlib.suppress(Exception):  # the process ends anyway: nothing to report it to
            action()
    say_stopped()
    exit_now(128 + (_State.sig or signal.SIGINT))
