"""Tools the tool-host tests call in the sandbox."""

import os
import subprocess
import time
from pathlib import Path

STATE = {"calls": 0}


def add(a: int, b: int) -> int:
    STATE["calls"] += 1
    return a + b + 0 * STATE["calls"]


def calls() -> int:
    return STATE["calls"]


def secret(path: str) -> str:
    return open(path).read()


def spin() -> None:
    while True:
        pass


def sleep(seconds: float) -> None:
    time.sleep(seconds)


def crash() -> None:
    os._exit(7)


def chatty() -> str:
    print("x" * 10_000_000)
    return "done"


def scratch() -> list:
    """The session's folder and what it held before this call wrote a file there."""
    before = os.listdir(".")
    with open("mine.txt", "w") as f:
        f.write("x")
    return [os.getcwd(), before]


def sleep_argv(tag: str) -> list[str]:
    """A `sleep` the tests find by its arguments (`tag`: unique to the test)."""
    return ["sleep", f"{tag}.5"]


def leave_behind(tag: str) -> None:
    """A process that outlives the call, out of the worker's process group (as a daemon would),
    returned once it runs `sleep` (so that a test sees it from outside)."""
    proc = subprocess.Popen(sleep_argv(tag), start_new_session=True)
    while not Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(b"sleep"):
        time.sleep(0.001)


def memory() -> int:
    return len(bytearray(4 << 30))


def wait_on(tag: str) -> None:
    """A call that waits on a process of its own (in the worker's group) that never ends."""
    subprocess.run(sleep_argv(tag))


def long() -> str:
    return "x" * 1_000_000
