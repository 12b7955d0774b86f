"""The processes `rl` started, found by descent, and how they are killed.

Invariant: a process is only signalled while its pid still names the process that was found (pid
and start time), and a child's descendants are killed with it, in whatever session they live:
torchrun starts each rank in a session of its own, so killing torchrun's process group alone would
leave the ranks (a stopped one forever).
"""

from __future__ import annotations

import contextlib
import os
import signal

from prime_rl.runtime.activity import ENGINE_CORE, State, start_ticks


def process_tree(root: int) -> list[int]:
    """`root` and every live process descended from it (read from /proc). By descent, not by
    process group: torchrun starts each rank in a session of its own."""
    return process_trees([root])[root]


def process_trees(roots: list[int]) -> dict[int, list[int]]:
    """`process_tree` of each root, from one read of /proc (`rl` looks at its children's trees every
    second, and /proc holds every process of the machine)."""
    children: dict[int, list[int]] = {}
    with os.scandir("/proc") as entries:
        for entry in entries:
            if entry.name.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    with open(f"/proc/{entry.name}/stat", "rb") as f:
                        stat = f.read()
                    fields = stat[stat.rindex(b")") + 2 :].split()
                    if fields[0] != b"Z":
                        children.setdefault(int(fields[1]), []).append(int(entry.name))
    trees = {}
    for root in roots:
        tree, todo = [], [root]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo += children.get(pid, [])
        trees[root] = sorted(tree)
    return trees


def tree_of(root: int) -> list[tuple[int, int]]:
    """`root` and its descendants, each as (pid, start time): a pid is only signalled later while it
    still names the same process."""
    return [(pid, start_ticks(pid)) for pid in process_tree(root)]


def kill_tree(group: int, tree: list[tuple[int, int]]) -> None:
    """SIGKILL process group `group` and every process of `tree` (`tree_of`, taken while its root
    lived), with their own groups: torchrun starts each rank in a session of its own, so killing
    torchrun's group alone would leave the ranks (a stopped one forever)."""
    live = [pid for pid, started in tree if started and start_ticks(pid) == started]
    for pid in live:  # stopped first, all of them: none starts another process meanwhile
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGSTOP)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
    for pid in live:
        with contextlib.suppress(OSError):
            pgid = os.getpgid(pid)
            if pgid not in (group, os.getpgrp()):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def kill_descendants(tree: list[tuple[int, int]]) -> None:
    """SIGKILL the processes of `tree` (`tree_of`) alone: not their process group, which they share
    with the parent that outlives them."""
    live = [pid for pid, started in tree if started and start_ticks(pid) == started]
    for sig in (signal.SIGSTOP, signal.SIGKILL):  # stopped first: none starts another meanwhile
        for pid in live:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)


def kill_culprit(culprit: State, roots: dict[str, int], trees: dict[str, list[int]]) -> str | None:
    """Kill the process a stall hangs on; return the name of the child of `rl` that was killed with
    it (its restart follows), None for none. An env worker is killed alone: the orchestrator fails its
    groups (counted) and starts another; so is vLLM's engine core in engine mode, which the orchestrator
    restarts (its groups dispatched again). `roots`: name -> pid of each live child; `trees`: its processes."""
    if not culprit.running():  # it ended while its stacks were taken (its pid may be another's now)
        return None
    if culprit.kind == "env-worker" or culprit.label == ENGINE_CORE:
        # Its parent, the orchestrator, notices and starts another in its place.
        kill_descendants(tree_of(culprit.pid))
        return None
    for name, root in roots.items():
        if culprit.pid in trees.get(name, ()):
            kill_tree(root, tree_of(root))  # SIGKILL: a stopped process ignores SIGTERM
            return name
    return None
