"""torchrun that keeps its ranks' exit status: `python -m prime_rl.trainer.parallel.torchrun <torchrun args>`.

torchrun ends with status 1 whenever a rank fails. `rl` must tell an error that a restart would
repeat (a rank's status 2: a config, model, checkpoint or disk error) from a crash or a kill, so this
runs torchrun's own launcher and ends with 2 when a rank did, else 1. The ranks have already printed
their one-line errors; torchrun's own failure report stays in the log. Stopped by SIGINT or
SIGTERM, it ends with 128 + the signal, without a traceback (the first rank says the line).
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


class _QuietStop(logging.Filter):
    """Drops torchrun's own lines about a stop by signal ("Received 2 death signal, shutting down
    workers", then one "Sending process ... closing signal" per rank): the first rank says it."""

    stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg.startswith("Received %s death signal"):
            _QuietStop.stopping = True
            return False
        return not (_QuietStop.stopping and msg.startswith("Sending process %s closing signal"))


def main(argv: list[str] | None = None) -> None:
    for name in (
        "torch.distributed.elastic.agent.server.api",
        "torch.distributed.elastic.multiprocessing.api",
    ):
        logging.getLogger(name).addFilter(_QuietStop())
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        raise SystemExit(2 if 2 in codes else 1) from None
    except SignalException as e:
        # Ctrl-C or SIGTERM: torchrun has stopped the ranks, and the first one said the line.
        raise SystemExit(128 + e.sigval) from None


if __name__ == "__main__":
    main()
