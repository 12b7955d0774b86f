"""Checks shared by the multi-turn and tool tests against real vLLM: run groups of an env through the
orchestrator's group runner while recording what the server received and sampled, and check that
every training sample holds exactly those tokens."""

import asyncio
import json

import torch

from prime_rl.orchestrator.config import ClientConfig
from prime_rl.orchestrator.envs.client import Clients
from prime_rl.orchestrator.envs.group_runner import GroupRun, run_group
from prime_rl.orchestrator.envs.load import load_env, rollout_input
from prime_rl.orchestrator.envs.v1_env import V1Env
from prime_rl.orchestrator.envs_config import EnvConfig, SamplingConfig
from prime_rl.orchestrator.loop.examples import ExampleSource
from prime_rl.orchestrator.loop.samples import rollout_to_samples, segments
from prime_rl.trainer.logprobs import forward_logprobs


class Wire:
    """Records what the server received and sampled: (prompt ids, [(token ids, logprobs)] per choice),
    by wrapping the client's HTTP exchange (under the group merging: what the server really got)."""

    def __init__(self, exchange):
        self.exchange, self.seen = exchange, []

    async def __call__(self, url, content):
        status, body = await self.exchange(url, content)
        data = json.loads(body)
        choices = [
            (c["token_ids"], [t["logprob"] for t in c["logprobs"]["content"]]) for c in data["choices"]
        ]
        self.seen.append((data["prompt_token_ids"], choices))
        return status, body


def rollouts_of(served, env_id: str, sampling: SamplingConfig, groups: int, until=None, size: int = 8):
    """Up to `groups` groups of `size` rollouts (fewer once `until(rollouts)` holds), and the wire."""
    env = load_env(EnvConfig(id=env_id, group_size=size, sampling=sampling))
    examples = ExampleSource(env.dataset, 0)
    url = f"{served.base}/v1"
    client = Clients(ClientConfig(base_urls=[url], timeout_s=60)).get(url)
    wire = client.client._exchange = Wire(client.client._exchange)

    async def go():  # one event loop for all groups: the client's connections belong to it
        out = []
        try:
            for _ in range(groups):
                row = examples.next()
                job = GroupRun(env.name, env.vf_env, rollout_input(row), row["example_id"], size, 0, sampling)
                out += await run_group(job, client, url, served.model, 60.0)
                if until is not None and until(out):
                    break
        finally:
            if isinstance(env.vf_env, V1Env):  # its interception servers live on this loop
                await env.vf_env._teardown()
        return out

    out = asyncio.run(go())
    assert not [r.error for r in out if r.failed]
    return out, wire, env


def as_served(message: dict) -> dict:
    """A message as vLLM hands it to the chat template: tool-call arguments parsed to objects."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for call in calls:
        f = dict(call["function"])
        try:
            f["arguments"] = json.loads(f["arguments"]) if isinstance(f["arguments"], str) else f["arguments"]
        except ValueError:
            f["arguments"] = {}
        parsed.append({**call, "function": f})
    return {**message, "tool_calls": parsed}


def turn_messages(rollout, k: int) -> list[dict]:
    """The messages the k-th model call was prompted with."""
    assistant = [i for i, m in enumerate(rollout.completion) if m["role"] == "assistant"]
    return [as_served(m) for m in list(rollout.prompt) + list(rollout.completion[: assistant[k]])]


def check_exact(
    rollout, wire: Wire | None, hf, template: str | None = None, tools: list | None = None
) -> None:
    model, tok = hf
    for k, turn in enumerate(rollout.turns):
        # What the server received is the chat template over the conversation so far ...
        rendered = tok.apply_chat_template(
            turn_messages(rollout, k), tools=tools, add_generation_prompt=True, chat_template=template,
            return_dict=False,
        )  # fmt: skip
        assert turn.prompt_ids == rendered
        # ... and the turn holds one of its answers exactly: tokens and sampling logprobs.
        if wire is not None:  # (v1 envs call the server through verifiers' own client)
            sampled = [c for p, cs in wire.seen if p == turn.prompt_ids for c in cs]
            assert (turn.completion_ids, turn.completion_logprobs) in sampled
    for sample, seg in zip(rollout_to_samples(rollout, 1.0), segments(rollout), strict=True):
        ids = sample.prompt_ids + sample.completion_ids
        n_prompt = len(sample.prompt_ids)
        expected_mask = [0] * len(sample.completion_ids)
        expected_lp = [0.0] * len(sample.completion_ids)
        for turn in seg:  # each turn is a prefix of the sample, its completion where it was sampled
            start = len(turn.prompt_ids)
            assert ids[: start + len(turn.completion_ids)] == turn.prompt_ids + turn.completion_ids
            for j, lp in enumerate(turn.completion_logprobs):
                expected_mask[start - n_prompt + j], expected_lp[start - n_prompt + j] = 1, lp
        assert sample.completion_mask == expected_mask  # env tokens in between: mask 0
        assert sample.completion_logprobs == expected_lp
        # The whole sample, scored at once by the trainer's model, gives the sampling logprobs back.
        with torch.no_grad():
            scored, _ = forward_logprobs(model, torch.tensor(ids), torch.arange(len(ids)), 1.0)
        trained = torch.tensor(sample.completion_mask, dtype=torch.bool)
        diff = scored[n_prompt:][trained] - torch.tensor(sample.completion_logprobs)[trained]
        assert diff.abs().max() < 1e-3
