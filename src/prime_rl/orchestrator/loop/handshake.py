"""The orchestrator's half of the run contract's handshake (`prime_rl.transport.contract`): the trainer gets
this orchestrator's side in a `Hello` (`sender.py`) and with every micro-batch; a trainer whose
config cannot work with it writes a refusal before it stops, which `wait_for_refusal` turns into
the same one-line error here.

Invariant: only a refusal naming this orchestrator's session counts, so a refusal left in the output
folder by an earlier run never stops a new one.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from prime_rl.transport.contract import ContractError

POLL_S = 0.5
"""How often to look for the trainer's refusal."""


def read_refusal(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


async def wait_for_refusal(path: Path, session: str) -> ContractError:
    """Returns (the error to stop with) once the trainer refused this session; runs until then."""
    while True:
        record = await asyncio.to_thread(read_refusal, path)  # a shared filesystem may be slow
        if isinstance(record, dict) and record.get("session") == session:
            return ContractError(f"the trainer refused this orchestrator's config: {record.get('message')}")
        await asyncio.sleep(POLL_S)
