"""Small networking helpers shared by the launcher and the tests.

Invariant: `free_port` hands out ports below the kernel's ephemeral range, which the OS itself never
picks (for `bind(("", 0))` or an outgoing connection), and never the same port twice in a process.
A port picked now and bound later (by a process started afterwards) so cannot be taken in between
by vLLM's own `get_open_port`, a torchrun store or a client socket.
"""

import random
import socket
from pathlib import Path

_handed_out: set[int] = set()
_rng = random.Random()  # its own: a test or trainer seeding `random` must not make processes agree


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on `host` and that the OS will not hand to anyone else."""
    low = _ephemeral_low()
    first = max(1024, low - 12000) if low > 2048 else None
    if first is not None:
        for _ in range(200):
            port = _rng.randrange(first, low)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    with socket.socket() as s:  # no room below the ephemeral range: let the OS pick
        s.bind((host, 0))
        return s.getsockname()[1]
