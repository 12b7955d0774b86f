"""One log format for every process: time, process name, message; quiet third-party loggers."""

import logging
import sys

ROLLOUT_FAILED = "rollout failed:"
"""Starts every per-rollout failure line: those go to the process's log, not to `rl`'s console,
whose step line counts them (and warns once per step when many fail)."""


def _not_verifiers_rollout_abort(record: logging.LogRecord) -> bool:
    # verifiers logs each failed rollout as an error; the scheduler logs the same failure with its
    # env and example, so verifiers' line would only repeat it.
    return not (record.name.startswith("verifiers") and str(record.msg).startswith("Aborted rollout"))


QUIETED = ("httpx", "openai", "verifiers", "datasets")
"""Third-party loggers held at WARNING in every process."""


def setup_logging(process: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_not_verifiers_rollout_abort)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {process} %(message)s", datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("prime_rl").setLevel(level)
    for noisy in QUIETED:
        logging.getLogger(noisy).setLevel(logging.WARNING)


def adopt_verifiers_logging() -> None:
    """Send verifiers' records through this process's handler (format, filter) again.

    Importing verifiers' classic API detaches its logger (no handler, no propagation) unless
    VF_LOG_LEVEL is set, so its errors reached stderr bare through Python's last-resort handler.
    Call it once verifiers is imported (after the envs are loaded).
    """
    library = logging.getLogger("verifiers")
    library.handlers.clear()
    library.propagate = True
