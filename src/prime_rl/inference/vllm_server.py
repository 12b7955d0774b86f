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
  this update and load the tensors as they arrive (`weight_transfer.py`), resume, answer `{"step": N}`.
  The trainer sends it (`weight_broadcast.type = "collective"`). A failed update (500) aborts the
  requests in flight and leaves the step at BROKEN (-2) until an update succeeds.
- `GET /prime_rl/weights`: `{"step": N, "workers": W, "dtype": D, "weights_dir": DIR}`, the step of
  the weights being served (0 = as started), the workers that join a broadcast group, the dtype they
  compute in (a broadcast sends floating-point weights in it), and the folder weights load from
  (resolved), which the orchestrator checks against its own at start-up.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from prime_rl import activity
from prime_rl.inference.adapters import make_adapter_router
from prime_rl.layout import READY

BROKEN = -2
"""The served step after a broadcast failed midway: part of the weights may be new."""


def make_router(weights_dir: Path) -> APIRouter:
    router = APIRouter()
    root = weights_dir.resolve()
    lock = asyncio.Lock()

    @router.post("/prime_rl/load_weights")
    async def load_weights(request: Request):
        try:
            body = await request.json()
            path, step = Path(str(body["path"])), int(body["step"])
            clear_cache = bool(body.get("clear_cache", False))
        except Exception:
            return JSONResponse({"error": 'expected JSON {"path": str, "step": int}'}, status_code=400)
        resolved = path.resolve()
        if resolved != root and root not in resolved.parents:
            return JSONResponse({"error": f"{path} is not under the weights dir {root}"}, status_code=403)
        if not (resolved / READY).exists():
            return JSONResponse({"error": f"{path} has no {READY} marker"}, status_code=404)
        engine = request.app.state.engine_client
        async with lock:
            t0 = time.perf_counter()
            activity.doing(f"loading the weights of step {step}", "", step)
            # Between two engine steps: running requests stay, with their KV cache, and go on with
            # the new weights (clearing the cache made every one of them recompute its prefix on
            # resume, which halved generation throughput with a reload every 0.5 s). New requests
            # do not reuse prefixes cached under older weights: the orchestrator salts the prefix
            # cache with the policy version (`cache_salt`).
            await engine.pause_generation(mode="keep", clear_cache=clear_cache)
            try:
                await engine.collective_rpc("prime_rl_reload", args=(str(resolved),))
            finally:
                await engine.resume_generation()
                Requests.say()
            request.app.state.prime_rl_step = step
        return {"step": step, "seconds": time.perf_counter() - t0}

    @router.post("/prime_rl/receive_weights")
    async def receive_weights(request: Request):
        try:
            body = await request.json()
            step = int(body["step"])
            args = (
                str(body["host"]),
                int(body["port"]),
                str(body["prefix"]),
                int(body["first_rank"]),
                int(body["world_size"]),
                list(body["plan"]),
                float(body["timeout_s"]),
            )
        except Exception:
            expected = '{"step", "host", "port", "prefix", "first_rank", "world_size", "plan", "timeout_s"}'
            return JSONResponse({"error": f"expected JSON {expected}"}, status_code=400)
        engine = request.app.state.engine_client
        async with lock:
            t0 = time.perf_counter()
            activity.doing(f"receiving the weights of step {step} from the trainer", "trainer", step)
            await engine.pause_generation(mode="keep", clear_cache=False)
            try:
                await engine.collective_rpc("prime_rl_receive", args=args)
                request.app.state.prime_rl_step = step
            except Exception as e:  # the trainer or the group went away mid-update
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

    @router.get("/prime_rl/weights")
    async def weights(request: Request):
        config = getattr(request.app.state, "vllm_config", None)
        workers = config.parallel_config.world_size if config is not None else 1
        dtype = str(config.model_config.dtype).removeprefix("torch.") if config is not None else None
        step = getattr(request.app.state, "prime_rl_step", 0)
        return {"step": step, "workers": workers, "dtype": dtype, "weights_dir": str(root)}

    return router


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
        try:
            await self.app(scope, receive, send)
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


def main() -> None:
    argv = sys.argv[1:]
    if "--prime-rl-weights-dir" not in argv:
        raise SystemExit("vllm_server: --prime-rl-weights-dir DIR is required")
    i = argv.index("--prime-rl-weights-dir")
    weights_dir = Path(argv[i + 1])
    del argv[i : i + 2]
    adapters_root = weights_dir
    if "--prime-rl-adapters-root" in argv:
        i = argv.index("--prime-rl-adapters-root")
        adapters_root = Path(argv[i + 1])
        del argv[i : i + 2]
    routers = [make_router(weights_dir), make_adapter_router(adapters_root)]
    label = os.environ.get(activity.ENV_LABEL, "inference")
    activity.start(label, "inference", weights_dir.parent, doing="starting vLLM")

    import vllm.entrypoints.launchers.api_server.entry as entry

    from prime_rl.inference.forked_engine import fork_engine_processes
    from prime_rl.inference.server import is_cpu_build

    if is_cpu_build():
        fork_engine_processes(entry)

    build_app = entry.build_app

    def build_app_with_reload(*args, **kwargs):
        app = build_app(*args, **kwargs)
        for router in routers:
            app.include_router(router)
        Requests.app = app
        if app.middleware_stack is None:
            app.add_middleware(Requests)
        else:  # vLLM built the stack already (its own middleware): wrap it
            app.middleware_stack = Requests(app.middleware_stack)
        Requests.say()
        return app

    entry.build_app = build_app_with_reload
    sys.argv = [sys.argv[0], *argv]
    entry.main()


if __name__ == "__main__":
    main()
