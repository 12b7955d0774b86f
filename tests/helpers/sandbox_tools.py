"""Tools the tool-host tests call in the sandbox."""

import os
import time

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
