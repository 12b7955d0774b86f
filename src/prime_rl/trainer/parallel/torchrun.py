"""torchrun that keeps its ranks' exit status: `python -m prime_rl.trainer.parallel.torchrun <torchrun args>`.

torchrun ends with status 1 whenever a rank fails. `rl` must tell an error that a restart would
repeat (a rank's status 2: a config, model, checkpoint or disk error) from a crash or a kill, so this
runs torchrun's own launcher and ends with 2 when a rank did, else 1. The ranks have already printed
their one-line errors; torchrun's own failure report stays in the log.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        raise SystemExit(2 if 2 in codes else 1) from None


if __name__ == "__main__":
    main()
