"""`python fork_ranks.py N SCRIPT ARGS...` (or `N -m MODULE ARGS...`): SCRIPT (MODULE) run as the N
ranks of one torch.distributed job, as `torchrun --nproc-per-node N SCRIPT ARGS...` runs it, but each
rank forked from this process after it imported what every rank imports (torch, transformers, the
trainer, MODULE's imports).

Started by torchrun, each rank imports them itself, against a fraction of a second for a step of a
tiny model: measured on 2 cores, a 2-rank launch of the grad worker took 7.9 s of CPU under torchrun
and takes 4.6 s forked, with the same gradients to the bit. The ranks are still separate
processes in a real gloo group, rendezvousing over a TCPStore (env://) with the variables torchrun
sets. For what torchrun itself does (its signals, its elastic agent), the tests use torchrun.

As with torchrun, a rank that fails stops the others, and the exit status is the first failed
rank's (0 when every rank succeeds). A rank dies with this process: a test that gives up on a launch
leaves no rank behind in a collective.
"""

import ctypes
import gc
import importlib
import os
import runpy
import signal
import sys
import time
import traceback

PR_SET_PDEATHSIG = 1


def run_rank(rank: int, world_size: int, port: int, target: str, args: list[str], module: bool) -> int:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    sys.argv = [target, *args]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python SCRIPT` has it
            runpy.run_path(target, run_name="__main__")
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
        return 1


def main() -> None:
    world_size, args = int(sys.argv[1]), sys.argv[2:]
    module = args[0] == "-m"
    target, args = (args[1], args[2:]) if module else (args[0], args[1:])
    # What the ranks import, imported once: each forked rank finds it loaded. With the collector
    # paused, and frozen before the forks: no rank's collection walks (and copies) it again.
    gc.disable()
    import torch.distributed  # noqa: F401
    import transformers.modeling_layers  # noqa: F401 (what loading a model imports, torch's compiler too)
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401

    import prime_rl.trainer.rl.trainer  # noqa: F401
    from prime_rl.runtime.net import free_port

    if module:
        importlib.import_module(target)  # its imports (it runs again, as __main__, in each rank)

    port = free_port()
    gc.freeze()
    gc.enable()
    ranks: dict[int, int] = {}
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            code = run_rank(rank, world_size, port, target, args, module)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        ranks[pid] = rank
    status = 0
    while ranks:
        pid, wait_status = os.wait()
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(wait_status)
        if code and not status:
            status = code if code > 0 else 128 - code
            sys.stderr.write(f"fork_ranks: rank {rank} exited with {code}; stopping the others\n")
            stop(list(ranks))
            break
    sys.exit(status)


def stop(pids: list[int]) -> None:
    """SIGTERM, then SIGKILL after 10 s to any rank still there; every one reaped."""
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def alive(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return False


if __name__ == "__main__":
    main()
