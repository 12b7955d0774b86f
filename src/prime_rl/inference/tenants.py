"""What a tenant of a shared inference server may ask of it (`auth/tenant.py` says who is one).

Invariant: a tenant reaches only the routes in `TENANT_ROUTES`: sampling, from the base model or an
adapter it holds; its own adapters (load, unload, list); the served step. Everything that changes
the base weights (`load_weights`, `receive_weights`), vLLM's own adapter and admin routes, and
`/metrics` (every tenant's adapter names) are the server owner's: refused (403) before any route
sees the request.
"""

from __future__ import annotations

import json

from prime_rl.inference.adapters import owner_of

SAMPLING = frozenset({"/v1/completions", "/v1/chat/completions"})
TENANT_ROUTES = SAMPLING | {
    "/v1/models",
    "/prime_rl/weights",
    "/prime_rl/adapters",
    "/prime_rl/load_adapter",
    "/prime_rl/unload_adapter",
}


def refusal(scope, body: bytes) -> str | None:
    """Why tenant `scope["prime_rl.caller"]` may not make this request, None when it may."""
    path = scope["path"]
    if path not in TENANT_ROUTES:
        return f"{path} is the server owner's, not a tenant's"
    if path not in SAMPLING:
        return None
    try:
        model = json.loads(body).get("model")
    except (ValueError, AttributeError):
        return "a sampling request names its model (JSON with a 'model')"
    state = scope["app"].state
    models = getattr(state, "openai_serving_models", None)
    if models is not None and isinstance(model, str) and models.is_base_model(model):
        return None
    held = getattr(state, "prime_rl_adapters", {}).get(model)
    if held is not None and held.owner == owner_of(scope, ""):
        return None
    return f"model {str(model)[:80]!r} is neither the base model nor one of this tenant's adapters"
