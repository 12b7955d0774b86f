"""Run `verifiers.v1` environments as the orchestrator runs classic ones: a group of rollouts of one
example against one inference server, returned as `Rollout`s.

A v1 env is a package exporting a `Taskset` subclass (and optionally an `Env` subclass for its own
control flow: several turns, several agents, group scoring in `finalize`). verifiers drives each
rollout through a harness whose model calls go through a local interception server, which records
them on the trace's message graph. Three things make that trainable here, all set up once:

- the harness is in-process chat (`ChatHarness`): the conversation so far, one chat completion,
  through the interception endpoint; no program to install, no sandbox;
- the client the interception uses upstream keeps vLLM's token ids and sampling logprobs, which
  verifiers' own chat client drops (without them nothing could train);
- verifiers 0.3.1's `verifiers.v1.tasksets` package imports an optional MCP integration that needs
  mcp<2, while vLLM needs mcp>=2: the package is registered without running its `__init__`, so
  taskset lookup works (only that integration's own taskset stays unavailable).

Invariant: `run_group` returns exactly `size` rollouts and raises only when cancelled. A v1 env
with group scoring returns one episode of several traces per call; one trace is one rollout.
"""

from __future__ import annotations

import asyncio
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prime_rl import secret
from prime_rl.environments import exports_v1_taskset
from prime_rl.orchestrator.envs.verifiers_v1_adapter import from_v1_trace
from prime_rl.orchestrator.rollout import Rollout, failed_rollout

HARNESS_ID = "prime_rl_chat_harness"
"""The module name verifiers resolves our harness by (harness ids are importable module names)."""

API_KEY_VAR = "PRIME_RL_V1_API_KEY"


def is_v1_module(module: types.ModuleType) -> bool:
    """Whether an env module is written against verifiers.v1: no classic `load_environment`, and a
    `Taskset` (or `Env`) subclass among its exports."""
    return not callable(getattr(module, "load_environment", None)) and exports_v1_taskset(module)


def _prepare() -> None:
    """One-time process setup (see the module docstring); idempotent."""
    if HARNESS_ID in sys.modules:
        return
    import verifiers.v1 as v1

    if "verifiers.v1.tasksets" not in sys.modules:
        package = types.ModuleType("verifiers.v1.tasksets")
        package.__path__ = [str(Path(v1.__file__).parent / "tasksets")]
        sys.modules["verifiers.v1.tasksets"] = package
    import verifiers.v1.interception.server as interception
    from verifiers.v1.clients import EvalClient, TrainClientConfig
    from verifiers.v1.types import TurnTokens

    class TokenClient(EvalClient):
        """verifiers' chat client, keeping the token ids and logprobs vLLM returns."""

        async def get_response(self, dialect, body, sampling, session_id=None, turn=None, headers=None):
            response = await super().get_response(dialect, body, sampling, session_id, turn, headers)
            raw = response.raw or {}
            choice = (raw.get("choices") or [{}])[0]
            prompt_ids, completion_ids = raw.get("prompt_token_ids"), choice.get("token_ids")
            if prompt_ids is not None and completion_ids is not None:
                content = (choice.get("logprobs") or {}).get("content") or []
                response.tokens = TurnTokens(
                    prompt_ids=prompt_ids,
                    completion_ids=completion_ids,
                    completion_logprobs=[t["logprob"] for t in content],
                )
            return response

    stock = interception.resolve_client
    interception.resolve_client = lambda config: (
        stock(config) if isinstance(config, TrainClientConfig) else TokenClient(config)
    )
    sys.modules[HARNESS_ID] = _harness_module(v1)
    os.environ[API_KEY_VAR] = secret.value() or "local"  # verifiers' client sends it to our servers


def _harness_module(v1) -> types.ModuleType:
    from openai import AsyncOpenAI
    from verifiers.v1.dialects.chat import message_to_wire

    # One client per interception endpoint and event loop: building an OpenAI client builds an SSL
    # context, which took 70% of the orchestrator's CPU when done per model call (py-spy).
    clients: dict[tuple[int, str], AsyncOpenAI] = {}

    def client_for(endpoint: str) -> AsyncOpenAI:
        loop = asyncio.get_running_loop()
        key = (id(loop), endpoint)
        if key not in clients:
            for stale in [k for k, c in clients.items() if k[0] != id(loop)]:
                del clients[stale]  # a finished loop's clients (tests run several loops)
            clients[key] = AsyncOpenAI(base_url=endpoint, api_key="per-request", max_retries=0)
        return clients[key]

    class ChatHarness(v1.Harness[v1.HarnessConfig]):
        """One chat completion on the conversation so far, through the interception endpoint."""

        APPENDS_SYSTEM_PROMPT = True
        SUPPORTS_RESUME = True  # verifiers relaunches it on the accumulated conversation per turn
        EXECUTES_CODE = False
        NEEDS_CONTAINER = False

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
            system, prompt = self.resolve_prompt(data)
            messages = [{"role": "system", "content": system}] if system else []
            if isinstance(prompt, str):
                messages.append({"role": "user", "content": prompt})
            elif prompt:
                messages += [message_to_wire(m) for m in prompt]
            await client_for(endpoint).chat.completions.create(
                model=ctx.model, messages=messages, extra_headers={"Authorization": f"Bearer {secret}"}
            )
            return v1.ProgramResult(exit_code=0, stdout="", stderr="")

    module = types.ModuleType(HARNESS_ID)
    module.ChatHarness = ChatHarness
    module.__all__ = ["ChatHarness"]
    return module


class TaskRows:
    """A v1 taskset as the rows `ExampleSource` streams: `example_id`, `prompt` (for the rollouts
    log) and the `task` itself. The taskset is listed once, at load (a v1 taskset may be a
    generator, and the example order is a seeded permutation of indices)."""

    column_names = ("prompt", "example_id", "task")

    def __init__(self, tasks: list):
        self.tasks = tasks

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, i: int) -> dict[str, Any]:
        task = self.tasks[i]
        return {"example_id": i, "prompt": task.data.prompt, "task": task}

    def select(self, indices) -> TaskRows:
        return TaskRows([self.tasks[i] for i in indices])


@dataclass
class V1Env:
    """A loaded v1 env, with the classic env's surface the orchestrator uses."""

    env: Any
    rows: TaskRows
    requires_group_rollouts: bool = False  # a group is `size` independent episodes
    _serving: Any = None

    def get_dataset(self, n: int | None = None) -> TaskRows:
        return self.rows if n is None else self.rows.select(range(min(n, len(self.rows))))

    get_eval_dataset = get_dataset

    async def _ensure_serving(self) -> None:
        if self._serving is None:
            self._serving = self.env.serving()
            await self._serving.__aenter__()

    async def _teardown(self) -> None:
        if self._serving is not None:
            serving, self._serving = self._serving, None
            await serving.__aexit__(None, None, None)

    async def run_group(
        self,
        inp: dict[str, Any],
        size: int,
        base_url: str,
        model: str,
        args: dict[str, Any],
        env_name: str,
        policy_version: int,
        state_columns: list[str],
        timeout_s: float,
    ) -> list[Rollout]:
        """`size` episodes of the task, each a rollout; an episode past `timeout_s` fails (verifiers'
        v1 client has no read timeout of its own)."""
        import verifiers.v1 as v1

        await self._ensure_serving()
        extra = dict(args.get("extra_body") or {})
        sampling = v1.SamplingConfig(
            temperature=args["temperature"],
            top_p=args["top_p"],
            max_tokens=args["max_tokens"],
            logprobs=True,
            extra_body=extra,
        )
        ctx = v1.ModelContext(
            model=model,
            client=v1.EvalClientConfig(base_url=base_url, api_key_var=API_KEY_VAR),
            sampling=sampling,
        )
        example_id = inp["example_id"]
        episodes = await asyncio.gather(
            *(
                asyncio.wait_for(self.env.run_slot(slot, ctx), timeout_s)
                for slot in self.env.slots(inp["task"], size)
            ),
            return_exceptions=True,
        )
        out: list[Rollout] = []
        for episode in episodes:
            if isinstance(episode, BaseException):
                if isinstance(episode, asyncio.CancelledError):
                    raise episode
                out.append(
                    failed_rollout(
                        env_name, example_id, policy_version, f"{type(episode).__name__}: {episode}"
                    )
                )
                continue
            if episode.errors:  # an env hook failed: none of the episode's traces is trustworthy
                message = "; ".join(f"{e.type}: {e.message}" for e in episode.errors)
                out += [
                    failed_rollout(env_name, example_id, policy_version, f"env error: {message}")
                    for _ in episode.traces or [None]
                ]
                continue
            for trace in episode.traces:
                out.append(from_v1_trace(trace, env_name, example_id, policy_version, state_columns))
        return out


def load_v1_env(env_id: str, args: dict[str, Any]) -> V1Env:
    """The v1 env `env_id` (its taskset, and its own `Env` class if it exports one) with `args` as
    its taskset config."""
    _prepare()
    import verifiers.v1 as v1

    taskset = {"id": env_id, **args}
    # Every role of the env (one `agent` for a plain taskset, the roles an env's own config names)
    # runs our harness in-process; what the env set for a role otherwise (e.g. max_turns) stays.
    roles = {
        name: value
        for name, value in v1.resolve_env_config({"taskset": taskset})
        if isinstance(value, v1.AgentConfig)
    }
    local = {"harness": {"id": HARNESS_ID}, "runtime": {"type": "subprocess"}}
    config = v1.resolve_env_config(
        {
            "taskset": taskset,
            **{name: {**role.model_dump(exclude_unset=True), **local} for name, role in roles.items()},
        }
    )
    env = v1.load_environment(config)
    return V1Env(env, TaskRows(list(env.taskset)))
