"""vLLM's OpenAI-compatible server plus narrow routes to load published weights in place.

`python -m prime_rl.inference.vllm_server --prime-rl-weights-dir DIR [--prime-rl-adapters-root DIR]
<vllm server args>`; the LoRA adapter routes are in `adapters.py` (their root defaults to DIR).

Routes added (nothing else: vLLM's development endpoints stay off):
- `POST /prime_rl/load_weights {"path": ..., "step": N}`: pause generation (in-flight requests are
  kept and continue afterwards), reload the weights from `path` in every worker, resume, and answer
  `{"step": N}`. Only folders under the weights dir that hold a `READY` marker are accepted
  (400 for a malformed body, 403 outside the weights dir, 404 for a folder that is not ready).
- `POST /prime_rl/receive_weights {"step": N, "host", "port", "prefix", "first_rank", "world_size",
  "plan", "timeout_s"}`: pause generation, have every worker join the trainer's broadcast group for
  this update and load the tensors as they arrive (`transport/weight_transfer.py`), resume, answer
  `{"step": N}`.
  The trainer sends it (`weight_broadcast.type = "collective"`). A failed update (500) aborts the
  requests in flight and leaves the step at BROKEN (-2) until an update succeeds.
- `GET /prime_rl/weights`: `{"step": N, "workers": W, "dtype": D, "weights_dir": DIR}`, the step of
  the weights being served (0 = as started), the workers that join a broadcast group, the dtype they
  compute in (a broadcast sends floating-point weights in it), and the folder weights load from
  (resolved), which the orchestrator checks against its own at start-up.

With a run secret (`runtime/secret.py`), every route but `/health` needs it (`Authorization: Bearer`): a
request without it, or with another, gets 401 and one line in the log, and changes nothing. A weight
update is taken only from the run's trainer: `load_weights` only for a folder `step_<step>`, and not
older than the weights served unless `"rewind": true` says so (the orchestrator, which owns the
run's version, does: a run restarted from an older checkpoint moves its servers back), `receive_weights` only from a store holding the
secret's proof for the update's prefix, for at most `--prime-rl-max-update-s` seconds and a plan no
bigger than a few times the served model.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from prime_rl.auth import signing
from prime_rl.auth.store import RemoteStore, StoreRefused
from prime_rl.inference.adapters import make_adapter_router
from prime_rl.inference.authenticated import Authenticated, log_refusal
from prime_rl.runtime import activity, secret
from prime_rl.runtime.imports import heavy_imports
from prime_rl.runtime.layout import READY, verify_weights
from prime_rl.transport.weight_transfer import DTYPES, chunk_bytes, plan_from_json

BROKEN = -2
"""The served step after a broadcast failed midway: part of the weights may be new."""

PLAN_SLACK = 4
"""A broadcast plan may be at most this many times the served weights' bytes: the trainer's names
differ from vLLM's (fused projections), and floating-point weights travel in the server's dtype."""

DEFAULT_MAX_UPDATE_S = 600.0


def make_router(weights_dir: Path, max_update_s: float = DEFAULT_MAX_UPDATE_S) -> APIRouter:
    router = APIRouter()
    root = weights_dir.resolve()
    lock = asyncio.Lock()

    async def model_bytes(request: Request) -> int:
        """The bytes of the weights every worker holds, summed (asked once)."""
        state = request.app.state
        if getattr(state, "prime_rl_model_bytes", None) is None:
            sizes = await state.engine_client.collective_rpc("prime_rl_weight_bytes")
            state.prime_rl_model_bytes = int(sum(sizes))
        return state.prime_rl_model_bytes

    async def update(request: Request, step: int, method: str, args: tuple, clear_cache: bool):
        """Run the workers' `method` between two engine steps and serve `step` after it. (The caller
        holds `lock`.) Running requests stay paused with their KV cache and go on with the new
        weights: clearing the cache made every one of them recompute its prefix on resume, which
        halved generation throughput with a reload every 0.5 s; new requests do not reuse prefixes
        cached under older weights, as the orchestrator salts the prefix cache with the policy
        version (`cache_salt`)."""
        engine = request.app.state.engine_client
        t0 = time.perf_counter()
        await engine.pause_generation(mode="keep", clear_cache=clear_cache)
        try:
            await engine.collective_rpc(method, args=args)
            request.app.state.prime_rl_step = step
        except Exception as e:  # a worker failed midway, or the trainer left mid-broadcast
            # Some tensors may be new and some old: no request may finish on such a model. Abort
            # the paused ones (their rollouts fail, counted) and say BROKEN until a good update,
            # so that the orchestrator keeps new work off this server.
            request.app.state.prime_rl_step = BROKEN
            await engine.pause_generation(mode="abort", clear_cache=True)
            return JSONResponse({"error": f"{type(e).__name__}: {e}"}, status_code=500)
        finally:
            await engine.resume_generation()
            Requests.say()
        return {"step": step, "seconds": time.perf_counter() - t0}

    @router.post("/prime_rl/load_weights")
    async def load_weights(request: Request):
        try:
            body = await request.json()
            path, step = Path(str(body["path"])), int(body["step"])
            clear_cache = bool(body.get("clear_cache", False))
            # Only the run's orchestrator sets the run's version back (without a secret, nobody is told apart).
            caller = request.scope.get("prime_rl.caller", signing.ORCHESTRATOR)
            rewind = bool(body.get("rewind", False)) and caller == signing.ORCHESTRATOR
        except Exception:
            return JSONResponse({"error": 'expected JSON {"path": str, "step": int}'}, status_code=400)
        resolved = path.resolve()
        if resolved != root and root not in resolved.parents:
            return JSONResponse({"error": f"{path} is not under the weights dir {root}"}, status_code=403)
        if resolved.name != f"step_{step}" or step < 0:
            # The step labels every rollout generated with these weights: it must be the folder's.
            return JSONResponse(
                {"error": f"{path} is not the folder of step {step} (step_{step})"}, status_code=400
            )
        if not (resolved / READY).exists():
            return JSONResponse({"error": f"{path} has no {READY} marker"}, status_code=404)
        problem = await asyncio.to_thread(verify_weights, resolved)  # before anything pauses
        if problem is not None:
            log_refusal(f"load_weights: {problem}")
            return JSONResponse({"error": f"not the run's trainer's weights: {problem}"}, status_code=403)
        async with lock:
            served = getattr(request.app.state, "prime_rl_step", 0)
            if step < served and not rewind:
                return JSONResponse(
                    {"error": f"step {step} is older than the served step {served}"}, status_code=409
                )
            activity.doing(f"loading the weights of step {step}", "", step)
            return await update(request, step, "prime_rl_reload", (str(resolved),), clear_cache)

    @router.post("/prime_rl/receive_weights")
    async def receive_weights(request: Request):
        try:
            body = await request.json()
            step = int(body["step"])
            host, port, prefix = str(body["host"]), int(body["port"]), str(body["prefix"])
            first_rank, world_size = int(body["first_rank"]), int(body["world_size"])
            plan = plan_from_json(list(body["plan"]))
            timeout_s = min(float(body["timeout_s"]), max_update_s)  # the server's bound, not the caller's
            if not (timeout_s > 0 and 1 <= first_rank < world_size and step >= 1):
                raise ValueError
            if any(e.dtype not in DTYPES or min(e.shape, default=0) < 0 for chunk in plan for e in chunk):
                raise ValueError
        except Exception:
            expected = '{"step", "host", "port", "prefix", "first_rank", "world_size", "plan", "timeout_s"}'
            return JSONResponse({"error": f"expected JSON {expected}"}, status_code=400)
        limit = PLAN_SLACK * await model_bytes(request)
        planned = sum(chunk_bytes(chunk) for chunk in plan)
        if planned > limit:
            return JSONResponse(
                {"error": f"the plan holds {planned} bytes, more than {PLAN_SLACK}x the served weights"},
                status_code=413,
            )
        try:  # before anything pauses: the store must prove it is the run's trainer's
            (await asyncio.to_thread(RemoteStore, host, port, timeout_s)).close()
        except (StoreRefused, OSError) as e:
            log_refusal(f"receive_weights: {e}")
            return JSONResponse({"error": str(e)}, status_code=403)
        # The trainer seals its chunks on CPU; a server with the secret takes only sealed ones there.
        sealed = bool(body.get("sealed", False)) or secret.value() is not None
        args = (host, port, prefix, first_rank, world_size, list(body["plan"]), timeout_s, sealed)
        async with lock:
            activity.doing(f"receiving the weights of step {step} from the trainer", "trainer", step)
            return await update(request, step, "prime_rl_receive", args, clear_cache=False)

    @router.get("/prime_rl/weights")
    async def weights(request: Request):
        config = getattr(request.app.state, "vllm_config", None)
        workers = config.parallel_config.world_size if config is not None else 1
        dtype = str(config.model_config.dtype).removeprefix("torch.") if config is not None else None
        step = getattr(request.app.state, "prime_rl_step", 0)
        return {"step": step, "workers": workers, "dtype": dtype, "weights_dir": str(root)}

    return router


STEP_HEADER = b"x-prime-rl-step"
"""Response header of every generation request: the served step when the answer started."""


class Requests:
    """ASGI middleware that keeps the activity record: how many generation requests are in flight,
    and, while there are some, how many batches of engine outputs came back (the record's progress,
    once a second), so that one long request is seen to move and a hung engine is seen not to.
    (A plain ASGI wrapper: a counter and a memory copy per request, nothing else.)"""

    in_flight = 0
    outputs = 0
    app = None
    """The FastAPI app: its engine client, once vLLM has made it."""
    ticking = False
    ticker: asyncio.Task | None = None
    """(Held: the loop keeps only a weak reference to a task.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        Requests.in_flight += 1
        if not Requests.ticking:
            Requests.count_outputs()
        Requests.say()

        async def stamped(message):
            # The policy version at the answer: a request answered whole carries the step whose
            # weights finished it (the orchestrator stamps its episodes with it).
            if message["type"] == "http.response.start":
                step = getattr(getattr(Requests.app, "state", None), "prime_rl_step", 0)
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (STEP_HEADER, str(step).encode())],
                }
            await send(message)

        try:
            await self.app(scope, receive, stamped)
        finally:
            Requests.in_flight -= 1
            Requests.say()

    @staticmethod
    def count_outputs() -> None:
        engine = getattr(getattr(Requests.app, "state", None), "engine_client", None)
        processor = getattr(engine, "output_processor", None)
        if processor is None or not hasattr(processor, "process_outputs"):
            return  # another vLLM: requests are counted, outputs not
        Requests.ticking = True
        original = processor.process_outputs

        def counted(*args, **kwargs):
            Requests.outputs += 1
            return original(*args, **kwargs)

        processor.process_outputs = counted  # looked up on the instance for every batch of outputs
        Requests.ticker = asyncio.get_running_loop().create_task(Requests.tick())

    @staticmethod
    async def tick() -> None:
        while True:
            await asyncio.sleep(activity.BEAT_S)
            activity.loop_beat()
            if Requests.in_flight:
                activity.progress(Requests.outputs)

    @staticmethod
    def say() -> None:
        if Requests.in_flight:
            activity.doing(f"generating, {Requests.in_flight} request(s)")
        else:
            activity.doing("idle, waiting for requests", "orchestrator")


def _take(argv: list[str], flag: str, default: str | None = None) -> str | None:
    """Remove `flag VALUE` from argv; its value (or `default`)."""
    if flag not in argv:
        return default
    i = argv.index(flag)
    value = argv[i + 1]
    del argv[i : i + 2]
    return value


def main() -> None:
    argv = sys.argv[1:]
    weights_dir = _take(argv, "--prime-rl-weights-dir")
    if weights_dir is None:
        raise SystemExit("vllm_server: --prime-rl-weights-dir DIR is required")
    weights_dir = Path(weights_dir)
    adapters_root = Path(_take(argv, "--prime-rl-adapters-root", str(weights_dir)))
    max_update_s = float(_take(argv, "--prime-rl-max-update-s", str(DEFAULT_MAX_UPDATE_S)))
    allow_open = secret.OPT_OUT_FLAG in argv
    if allow_open:
        argv.remove(secret.OPT_OUT_FLAG)
    host = secret.bound_host(argv, "0.0.0.0")  # vLLM's default: every interface
    try:
        secret.value()
        secret.require_for_bind(host, "the inference server", allow_open)
    except secret.SecretError as e:
        raise SystemExit(f"vllm_server: {e}") from None
    adapter_router = make_adapter_router(adapters_root)
    routers = [make_router(weights_dir, max_update_s), adapter_router]
    label = os.environ.get(activity.ENV_LABEL, "inference")
    activity.start(label, "inference", weights_dir.parent, doing="starting vLLM")

    with heavy_imports(freeze=True):  # this process's own start
        import vllm.entrypoints.launchers.api_server.entry as entry

        from prime_rl.engine.forked import fork_engine_processes
        from prime_rl.engine.front_end import speed_up_front_end
        from prime_rl.engine.server import is_cpu_build

    if is_cpu_build():
        fork_engine_processes(entry)
    speed_up_front_end()  # this process is vLLM's front end: it builds every answer's logprobs

    build_app = entry.build_app

    def build_app_with_reload(*args, **kwargs):
        app = build_app(*args, **kwargs)
        for router in routers:
            app.include_router(router)
        Requests.app = app
        app.state.prime_rl_adapters = adapter_router.served  # (whose adapter a tenant samples)
        if app.middleware_stack is None:
            app.add_middleware(Requests)
            app.add_middleware(Authenticated)  # added last: the outermost
        else:  # vLLM built the stack already (its own middleware): wrap it
            app.middleware_stack = Authenticated(Requests(app.middleware_stack))
        Requests.say()
        return app

    entry.build_app = build_app_with_reload
    sys.argv = [sys.argv[0], *argv]
    entry.main()


if __name__ == "__main__":
    main()
