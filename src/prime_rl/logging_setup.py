"""One log format for every process: time, process name, message; quiet third-party loggers."""

import logging
import sys


def setup_logging(process: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {process} %(message)s", datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("prime_rl").setLevel(level)
    for noisy in ("httpx", "openai", "verifiers", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
