"""One POST with retries, shared by the orchestrator's HTTP clients (reward server, teacher).

Invariant: a connection error, a timeout or a 5xx answer is retried `retries` times with exponential
backoff (0.5 s, 1 s, 2 s, ... at most 5 s); any other non-200 answer fails at once, since repeating a
request the server refused cannot help. Every failure raises `error` with a message that names the
server (`what`) and the last cause.
"""

from __future__ import annotations

import asyncio
from typing import Any


def backoff_s(attempt: int) -> float:
    """Seconds to wait before retry number `attempt` (1-based)."""
    return min(0.5 * 2 ** (attempt - 1), 5.0)


async def post_json(
    client, url: str, body: Any, *, retries: int, timeout_s: float, what: str, error: type[Exception]
) -> Any:
    """POST `body` as JSON to `url` with `client` (an httpx.AsyncClient); the decoded answer."""
    import httpx

    last = ""
    for attempt in range(retries + 1):
        if attempt:
            await asyncio.sleep(backoff_s(attempt))
        try:
            response = await client.post(url, json=body)
        except httpx.TimeoutException:
            last = f"no answer within {timeout_s:g}s"
            continue
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
            continue
        if response.status_code >= 500:
            last = f"HTTP {response.status_code}: {response.text[:200]}"
            continue
        if response.status_code != 200:
            raise error(f"{what}: HTTP {response.status_code}: {response.text[:300]}")
        return response.json()
    raise error(f"{what} failed {retries + 1} time(s), last: {last}")
