"""Routes that serve runs' LoRA adapters by name: several runs share one vLLM server, each training
its own adapter of the one base model.

- `POST /prime_rl/load_adapter {"name", "owner", "path"?, "step"?}`: claim `name` for `owner` (a
  token only the run knows, derived from its secret: `secret.owner_token`) and, with `path`, load that
  published step's adapter under it, in place of the previous step's. 409 when another run holds the
  name or the server was started without LoRA, 403 for a path outside the adapters root, 404 for a
  folder without `READY`, 400 for a bad body.
- `POST /prime_rl/unload_adapter {"name", "owner"}`: release the name (a finished run).
- `GET /prime_rl/adapters` (the owner token in the `X-Prime-RL-Owner` header): `{"enabled": bool,
  "max_rank": R, "root": DIR, "adapters": {name: {"step"}}}`, the caller's own adapters only
  (`root`: the adapters root, resolved).

Invariants: a name belongs to one owner from its claim to its release, so no run ever samples from
another's adapter; the server keeps only a hash of each owner's token, and never shows a run another
run's adapters, names included. Loading happens between two engine steps (an engine utility call), so it never
pauses generation: the other runs' requests go on, and this run's requests in flight continue with
the new adapter, as with a full-weight reload. Requests name the adapter, and the vLLM request that
serves them never asks for a reload: only this route loads from disk.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from prime_rl.auth import signing
from prime_rl.runtime import secret
from prime_rl.runtime.layout import READY


def _digest(owner: str) -> str:
    return hashlib.sha256(owner.encode()).hexdigest()


def tenant_of(request_or_scope) -> str | None:
    """The tenant a request was signed by (`auth/tenant.py`), None for the server's own run."""
    scope = getattr(request_or_scope, "scope", request_or_scope)
    caller = scope.get("prime_rl.caller")
    return caller if caller not in (None, signing.OWNER, signing.ORCHESTRATOR) else None


def owner_of(request_or_scope, token: str) -> str:
    """Who holds an adapter claimed by this request: a tenant by its name, whatever token it gives
    (so that no tenant can name another's adapters), the server's own run by its owner token."""
    tenant = tenant_of(request_or_scope)
    return _digest(f"tenant:{tenant}") if tenant is not None else _digest(token)


@dataclass
class Served:
    owner: str
    """The SHA-256 of the owner's token (the token itself is never kept)."""
    step: int = 0
    """0: claimed, nothing loaded (requests go to the base model, which an untrained adapter equals)."""


def make_adapter_router(root: Path) -> APIRouter:
    router = APIRouter()
    root = root.resolve()
    served: dict[str, Served] = {}
    locks: dict[str, asyncio.Lock] = {}

    def enabled(request: Request) -> int:
        """The server's maximum adapter rank, 0 without LoRA."""
        config = getattr(request.app.state, "vllm_config", None)
        lora = getattr(config, "lora_config", None) if config is not None else None
        return int(lora.max_lora_rank) if lora is not None else 0

    def refuse(status: int, error: str) -> JSONResponse:
        return JSONResponse({"error": error}, status_code=status)

    @router.post("/prime_rl/load_adapter")
    async def load_adapter(request: Request):
        try:
            body = await request.json()
            name, owner = str(body["name"]), owner_of(request, str(body["owner"]))
            path = Path(str(body["path"])) if body.get("path") is not None else None
            step = int(body.get("step", 0))
            if not name or not owner:
                raise ValueError
        except Exception:
            return refuse(400, 'expected JSON {"name": str, "owner": str, "path"?: str, "step"?: int}')
        if not enabled(request):
            return refuse(409, "this server was started without LoRA: start it with [inference.lora]")
        if request.app.state.openai_serving_models.is_base_model(name):
            return refuse(409, f"'{name}' is the served base model's name, not an adapter's")
        async with locks.setdefault(name, asyncio.Lock()):
            held = served.get(name)
            if held is not None and not hmac.compare_digest(held.owner, owner):
                return refuse(409, f"adapter name '{name}' is used by another run")
            if path is None:
                served.setdefault(name, Served(owner))
                return {"name": name, "step": served[name].step}
            resolved = path.resolve()
            if resolved != root and root not in resolved.parents:
                return refuse(403, f"{path} is not under the adapters root {root}")
            if not (resolved / READY).exists():
                return refuse(404, f"{path} has no {READY} marker")
            t0 = time.perf_counter()
            try:
                await _load(request.app.state, name, str(resolved))
            except Exception as e:  # a malformed adapter, a rank above the server's maximum
                return refuse(422, f"the adapter at {path} does not load: {type(e).__name__}: {e}")
            served[name] = Served(owner, step)
        return {"name": name, "step": step, "seconds": time.perf_counter() - t0}

    @router.post("/prime_rl/unload_adapter")
    async def unload_adapter(request: Request):
        try:
            body = await request.json()
            name, owner = str(body["name"]), owner_of(request, str(body["owner"]))
        except Exception:
            return refuse(400, 'expected JSON {"name": str, "owner": str}')
        async with locks.setdefault(name, asyncio.Lock()):
            held = served.get(name)
            if held is None:
                return {"name": name, "released": False}
            if not hmac.compare_digest(held.owner, owner):
                return refuse(409, f"adapter name '{name}' is used by another run")
            await _unload(request.app.state, name)
            del served[name]
        return {"name": name, "released": True}

    @router.get("/prime_rl/adapters")
    async def adapters(request: Request):
        rank = enabled(request)
        caller = owner_of(request, request.headers.get(secret.OWNER_HEADER, ""))
        mine = {n: {"step": s.step} for n, s in served.items() if hmac.compare_digest(s.owner, caller)}
        return {"enabled": bool(rank), "max_rank": rank, "root": str(root), "adapters": mine}

    router.served = served  # (the door checks a tenant's sampling requests against it: `tenants.py`)
    return router


async def _load(state, name: str, path: str) -> None:
    """Load the adapter at `path` under `name`, replacing the one loaded under it before."""
    from vllm.lora.request import LoRARequest

    models = state.openai_serving_models
    previous = models.lora_requests.get(name)
    lora_id = previous.lora_int_id if previous is not None else models.lora_id_counter.inc(1)
    # `load_inplace` makes the engine read the files again; requests must carry a request without
    # it, or every engine step that schedules one would reload the adapter from disk.
    await state.engine_client.add_lora(LoRARequest(name, lora_id, path, load_inplace=True))
    models.lora_requests[name] = LoRARequest(name, lora_id, path)


async def _unload(state, name: str) -> None:
    models = state.openai_serving_models
    previous = models.lora_requests.pop(name, None)
    if previous is not None:
        await state.engine_client.remove_lora(previous.lora_int_id)
