"""The process's place among the trainer ranks (torchrun sets RANK / WORLD_SIZE / LOCAL_RANK).

The world is dp x cp ranks: `cp` consecutive ranks form one context-parallel group that shares each
micro-batch of one data-parallel replica (rank = dp_rank * cp + cp_rank, so a group sits on one node
whenever cp divides the ranks per node). FSDP shards parameters over the whole world, and the loss is
normalized by the loss tokens of the whole world. Expert parallelism lays a second grid over the same
ranks: `ep` consecutive ranks form one expert-parallel group (each holds 1/ep of every MoE layer's
experts), and the ranks with the same place in their groups hold the same experts, which FSDP shards
among them (`ep_mesh`, dims "edp" x "ep"). ep is independent of dp and cp: it only has to divide the
world.

Which traffic goes where. On CUDA the process group has two backends, `cpu:gloo,cuda:nccl`, and
torch picks one by the device of each call's tensors:
- nccl (GPU tensors): everything on a training step's path. FSDP's all-gathers and reduce-scatters,
  context parallelism's key/value all-gather and gradient reduce-scatter, the global loss-token
  count, the loss and token sums, the metrics' moments, gradient-norm reductions. These go through
  `World.scalars` (host numbers enter on the device) and `all_reduce_sum`
  / `all_reduce_max` (device tensors); a CPU tensor on this path is a bug (a gloo round trip per
  call, and on nccl alone an error) that the fake-GPU dry run (`dry_run.py`) reports.
- gloo (CPU tensors): the control plane, a few small Python objects per step or per run. Object
  collectives (`all_gather_object`, `broadcast_object_list`: env names of the metrics, the
  checkpoint to resume from, the micro-batch bytes the cp leader shares with its group) and
  barriers around checkpoint and export files.
On CPU gloo carries both. The step's device-to-host copies go through `World.host`, so a step syncs
with the device a known number of times.

Collectives give up. Every group a rank is in (the world, the cp groups, FSDP's and expert
parallelism's meshes) times out after `dist_timeout_s` (torch's defaults: 30 min on gloo, 10 min on
nccl): a rank whose peer died or hung stops within that bound. Where a rank waits in a collective for
one rank's own work rather than for its peers (a cp peer waiting for its leader's data, ranks waiting
for rank 0 to verify or write a checkpoint's manifest) the wait is `patient`: it may last as long as
that work may. A gloo collective that times out or loses its peer raises a RuntimeError;
`collective_failure` tells it from other errors, and `run_rank` makes it one line naming the
collective (and the step, when the loop knows it), exit status 1: a restart can fix it. nccl's
watchdog ends a rank itself (SIGABRT) when a GPU collective times out, within the same bound.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from prime_rl.runtime import activity
from prime_rl.runtime.shutdown import Stopped, exit_now, say_stopped, stopping

FILE_WORK_TIMEOUT_S = 1800.0
"""How long ranks wait in a collective for one rank's work on files that grow with the model
(verifying the checkpoint to resume from, writing a checkpoint's manifest): torch's own default,
which these waits had before `dist_timeout_s`, so a healthy run with a large checkpoint never
takes them for a dead peer."""

FAKE_HOST_VALUE = 1.0
"""What `World.host` reads from a fake tensor: finite and non-zero, so a dry run takes the branches
of an ordinary step (a step with loss tokens, a finite loss, an optimizer update)."""


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    cp: int = 1
    """Context-parallel ranks per data-parallel replica."""
    cp_group: dist.ProcessGroup | None = None
    """This rank's context-parallel group (None when cp = 1)."""
    mesh: Any = None
    """FSDP's DeviceMesh over all ranks, on the training device (None on one rank)."""
    ep: int = 1
    """Expert-parallel ranks: each MoE layer's experts are split across this many consecutive ranks."""
    ep_mesh: Any = None
    """The 2-D DeviceMesh ("edp", "ep") of expert parallelism: "ep" splits the experts, "edp" holds
    the copies of one split (None when ep = 1)."""
    fake: bool = False
    """A dry run (`dry_run.py`): tensors carry a device but no data, and host copies read
    FAKE_HOST_VALUE."""
    timeout_s: float | None = None
    """How long a collective of any of this rank's groups waits for its peers before it fails
    (`dist_timeout_s`; None: torch's defaults, for one rank and the dry run's fake group)."""

    def scalars(self, *values: float) -> torch.Tensor:
        """Host numbers as one float64 tensor on the training device, where the step's collectives
        run (every host number that enters a collective comes through here)."""
        return torch.tensor(values, dtype=torch.float64, device=self.device)

    def host(self, tensor: torch.Tensor) -> Any:
        """`tensor.tolist()`: the one way a step copies device values to the host."""
        if self.fake:
            return _filled(list(tensor.shape), FAKE_HOST_VALUE)
        return tensor.tolist()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp(self) -> int:
        return self.world_size // self.cp

    @property
    def dp_rank(self) -> int:
        """Which replica's micro-batches this rank trains on (the orchestrator's trainer rank)."""
        return self.rank // self.cp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    @property
    def cp_leader(self) -> int:
        """Global rank of this group's cp rank 0 (it receives the group's micro-batches)."""
        return self.dp_rank * self.cp

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """This rank's expert-parallel group (None when ep = 1)."""
        return self.ep_mesh["ep"].get_group() if self.ep_mesh is not None else None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


class WorldError(RuntimeError):
    """The ranks cannot be arranged as configured."""


def init_world(cp: int = 1, ep: int = 1, timeout_s: float | None = None) -> World:
    """This rank's World; with several ranks, the process group and every sub-group, each timing out
    after `timeout_s` (None: torch's defaults)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size % cp:
        raise WorldError(
            f"trainer.parallel.cp = {cp} does not divide the {world_size} trainer ranks: "
            "the ranks must be data-parallel replicas of cp ranks each"
        )
    if world_size % ep:
        raise WorldError(
            f"trainer.parallel.ep = {ep} does not divide the {world_size} trainer ranks: "
            "the ranks must split into expert-parallel groups of ep ranks each"
        )
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        # Two backends on CUDA: the step's tensors on nccl, object collectives on gloo (module docstring).
        dist.init_process_group(
            backend="cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
            timeout=timedelta(seconds=timeout_s) if timeout_s is not None else None,
        )
    return arrange(rank, world_size, local_rank, device, cp, ep=ep, timeout_s=timeout_s)


def arrange(
    rank: int,
    world_size: int,
    local_rank: int,
    device: torch.device,
    cp: int,
    fake: bool = False,
    ep: int = 1,
    timeout_s: float | None = None,
) -> World:
    """The World of this rank in an initialized process group: cp groups and FSDP's meshes, every
    group timing out after `timeout_s` (None: torch's defaults)."""
    # A sub-group does not take the world's timeout: new_group without one gets torch's default.
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    cp_group = None
    if cp > 1:
        # Every rank creates every group, in the same order (a collective on the world).
        for first in range(0, world_size, cp):
            group = dist.new_group(list(range(first, first + cp)), timeout=timeout)
            if first <= rank < first + cp:
                cp_group = group
    mesh = None
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        # Explicit, so FSDP shards onto the training device (its default mesh follows whatever
        # accelerator torch finds, which is not the fake GPU of a dry run). A 1-D mesh over the
        # world is the world's own group, with its timeout.
        mesh = init_device_mesh(device.type, (world_size,))
    ep_mesh = None
    if ep > 1:
        ep_mesh = _ep_mesh(device.type, rank, world_size, ep, timeout)
    return World(
        rank,
        world_size,
        local_rank,
        device,
        cp,
        cp_group,
        mesh,
        fake=fake,
        ep=ep,
        ep_mesh=ep_mesh,
        timeout_s=timeout_s,
    )


def _ep_mesh(device_type: str, rank: int, world_size: int, ep: int, timeout: timedelta | None) -> Any:
    """The ("edp", "ep") mesh of expert parallelism, from groups made here: `init_device_mesh`
    would make a 2-D mesh's groups with torch's default timeout, not the world's."""
    from torch.distributed.device_mesh import DeviceMesh

    grid = torch.arange(world_size).reshape(world_size // ep, ep)
    groups = {}
    # Every rank creates every group, in the same order; it keeps the one of each dimension it is in.
    for name, lines in (("edp", grid.t()), ("ep", grid)):
        for line in lines.tolist():
            group = dist.new_group(line, timeout=timeout)
            if rank in line:
                groups[name] = group
    return DeviceMesh.from_group(
        [groups["edp"], groups["ep"]], device_type, grid, mesh_dim_names=("edp", "ep")
    )


def init_world_or_exit(cp: int, prog: str, ep: int = 1, timeout_s: float | None = None) -> World:
    """`init_world` for a console script: a rank layout that cannot work is one line and exit 2."""
    try:
        return init_world(cp, ep, timeout_s)
    except WorldError as e:
        if os.environ.get("RANK", "0") == "0":  # one line for the run, not one per rank
            sys.stderr.write(f"{prog}: error: {e}\n")
        raise SystemExit(2) from None


def _filled(shape: list[int], value: float) -> Any:
    if not shape:
        return value
    return [_filled(shape[1:], value) for _ in range(shape[0])]


def all_reduce_sum(value: torch.Tensor, world: World) -> torch.Tensor:
    if world.distributed:
        with activity.waiting("an all_reduce (sum)", "trainer"):
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def all_reduce_max(value: torch.Tensor, world: World) -> torch.Tensor:
    if world.distributed:
        with activity.waiting("an all_reduce (max)", "trainer"):
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value


@contextlib.contextmanager
def patient(world: World, seconds: float, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Inside, this rank's collectives on `group` (default: the world's) wait up to `seconds` when that
    is longer than `World.timeout_s`: for a wait on one rank's own work (its data, a checkpoint's
    files), which is no peer's failure however long it takes within that bound."""
    if not world.distributed or world.timeout_s is None or seconds <= world.timeout_s:
        yield
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timedelta(seconds=seconds), group)
    try:
        yield
    finally:
        _set_pg_timeout(timedelta(seconds=world.timeout_s), group)


class CollectiveFailed(RuntimeError):
    """A collective with the other ranks timed out or lost a peer: one line, exit status 1 (a
    restart can fix it)."""


TIMED_OUT = ("timed out waiting", "application timeout caused pair closure")
"""gloo's words for a collective that timed out (the second: a later one on the same pair)."""

PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited")
"""gloo's and nccl's words for a collective whose peer is gone (its process died)."""


def collective_failure(e: BaseException) -> str | None:
    """'timed out' or 'lost' (a peer) for the error of a collective that failed so, else None. gloo
    raises a plain RuntimeError (the project's errors are subclasses of it, never taken for one),
    nccl and torch's store a DistError; only their words for a timeout or a lost peer count, so a
    collective's misuse (a bug) keeps its traceback."""
    if not (type(e) is RuntimeError or isinstance(e, dist.DistError)):
        return None
    text = str(e).lower()
    if any(w in text for w in TIMED_OUT) or (isinstance(e, dist.DistError) and "timeout" in text):
        return "timed out"
    if any(w in text for w in PEER_LOST):
        return "lost"
    return None


def collective_name(tb: TracebackType | None) -> str | None:
    """The torch.distributed call a failure came from: the outermost public function of c10d
    (broadcast_object_list, not the broadcast it calls), else the innermost frame in
    torch.distributed (FSDP's collectives), else None."""
    frames = [frame.f_code for frame, _ in traceback.walk_tb(tb)]
    inside = [c.co_name for c in frames if f"{os.sep}torch{os.sep}distributed{os.sep}" in c.co_filename]
    c10d = [
        c.co_name
        for c in frames
        if c.co_filename.endswith("distributed_c10d.py") and not c.co_name.startswith("_")
    ]
    return c10d[0] if c10d else (inside[-1] if inside else None)


def collective_error(e: BaseException, world: World, key: str, step: int | None = None) -> CollectiveFailed:
    """The one line for `e` (`collective_failure(e)` is not None): the rank, the step when known,
    the collective, and what to suspect. `key` is the config key of `World.timeout_s`."""
    what = f"a collective ({name})" if (name := collective_name(e.__traceback__)) else "a collective"
    where = f"rank {world.rank}" + (f", step {step}" if step is not None else "")
    if collective_failure(e) == "lost":
        return CollectiveFailed(
            f"{where}: {what} failed: another rank closed its connection (its process ended)"
        )
    # gloo says how long it waited: `patient` may have made it longer than the key's value.
    waited = re.search(r"timed out waiting (\d+)\s*ms", str(e), re.I)
    seconds = int(waited.group(1)) / 1000 if waited else world.timeout_s
    if seconds is None:
        within = "in time"
    elif world.timeout_s is not None and math.isclose(seconds, world.timeout_s):
        within = f"within {key} = {seconds:g} s"
    else:
        within = f"within {seconds:g} s"
    return CollectiveFailed(f"{where}: {what} did not complete {within}: another rank died or hung")


def run_rank(
    world: World,
    prog: str,
    fn: Callable[[], object],
    user_errors: tuple[type[BaseException], ...],
    needs_user: tuple[type[BaseException], ...] = (),
    timeout_key: str = "dist_timeout_s",
) -> None:
    """Run a rank's work and end the process: a user error is one line on stderr and exit status 2
    if it is one of `needs_user` (a restart would fail the same way), else 1; so is a collective
    that timed out or lost its peer (`collective_failure`; `timeout_key` names the timeout's key),
    with status 1; a SIGINT or SIGTERM is the stop's one line and 128 + the signal
    (`prime_rl.runtime.shutdown`), also when what it raised is an error the stop caused (a peer rank gone);
    the process group is destroyed in any case; a distributed rank always leaves through `exit_rank`."""
    code = 0
    try:
        fn()
    except Stopped:
        pass
    except (CollectiveFailed, *user_errors) as e:
        if stopping() is None:
            sys.stderr.write(f"{prog}: error: {e}\n")
        code = 2 if isinstance(e, needs_user) else 1
    except Exception as e:
        if not world.distributed and stopping() is None:
            raise
        if stopping() is None and collective_failure(e):
            sys.stderr.write(f"{prog}: error: {collective_error(e, world, timeout_key)}\n")
        elif stopping() is None:
            traceback.print_exc()
        code = 1
    finally:
        close_world(world)
    if stopping() is not None:
        say_stopped()
        code = 128 + stopping()
    exit_rank(world, code)


def close_world(world: World) -> None:
    """Destroy the process group (every rank, also after an error)."""
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def exit_rank(world: World, code: int) -> None:
    """End the process with `code`. A distributed rank skips interpreter finalization: gloo's worker
    threads can still be releasing a finished collective whose tensors hold Python objects, and if
    that happens while the interpreter shuts down the thread cannot take the GIL and the process
    aborts (SIGABRT, "terminate called without an active exception"; about 1 exit in 30 on 2 cores
    with torch 2.13, after a clean run). Everything the rank wrote is closed before this is called."""
    if world.distributed:
        exit_now(code)
    if code:
        raise SystemExit(code)
