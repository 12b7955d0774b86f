"""Checks shared by the multi-turn and tool tests against real vLLM: run groups of an env through the
orchestrator's group runner while recording what the server received and sampled, and check that
every training sample holds exactly those tokens."""

import asyncio

import torch

from prime_rl.orchestrator.config import ClientConfig
from prime_rl.orchestrator.envs.client import Clients
from prime_rl.orchestrator.envs.group_runner import GroupRun, run_group
from prime_rl.orchestrator.envs.load import load_env
from prime_rl.orchestrator.envs.renderer import Renderer
from prime_rl.orchestrator.envs_config import EnvConfig, SamplingConfig
from prime_rl.orchestrator.loop.examples import ExampleSource
from prime_rl.orchestrator.loop.samples import rollout_to_samples, segments
from prime_rl.trainer.logprobs import forward_logprobs


class Wire:
    """Records what the server received and sampled: (prompt ids, [(token ids, logprobs)] per
    completion), by wrapping the sampler (under the group merging: what the server really got)."""

    def __init__(self, sampler):
        self.sampler, self.seen = sampler, []

    async def sample(self, prompt_ids, args, n=1):
        completions = await self.sampler.sample(prompt_ids, args, n)
        self.seen.append((list(prompt_ids), [(c.token_ids, c.logprobs) for c in completions]))
        return completions

    async def close(self):
        await self.sampler.close()


def rollouts_of(
    served,
    env_id: str,
    sampling: SamplingConfig,
    groups: int,
    until=None,
    size: int = 8,
    renderer=None,
    args=None,
):
    """Up to `groups` groups of `size` rollouts (fewer once `until(rollouts)` holds) and the wire (the
    env is closed after: a tool env's host with it); `renderer`: the chat template the orchestrator renders with (default: the served model's)."""
    env = load_env(EnvConfig(id=env_id, args=args or {}, group_size=size, sampling=sampling))
    examples = ExampleSource(env.examples, 0)
    url = f"{served.base}/v1"
    renderer = renderer or Renderer.for_model(served.model)

    async def go():  # one event loop for all groups: the sampler's connections belong to it
        wire = Wire(Clients(ClientConfig(base_urls=[url], timeout_s=60), served.model).get(url))
        out = []
        try:
            for _ in range(groups):
                example = examples.next()
                task = env.vf_env.task(example.task)
                job = GroupRun(env.name, env.vf_env, task, example.example_id, size, 0, sampling)
                out += await run_group(job, wire, renderer, served.model, 60.0)
                if until is not None and until(out):
                    break
        finally:
            await wire.close()
            await env.vf_env.close()
        return out, wire

    out, wire = asyncio.run(go())
    assert not [r.error for r in out if r.failed]
    return out, wire


def turn_messages(rollout, k: int) -> list[dict]:
    """The messages the k-th model call was prompted with."""
    assistant = [i for i, m in enumerate(rollout.completion) if m["role"] == "assistant"]
    return list(rollout.prompt) + list(rollout.completion[: assistant[k]])


def check_exact(rollout, wire: Wire, hf, renderer=None, tools: list | None = None) -> None:
    """Each turn is what the server got and sampled; the first is the chat template over the prompt,
    each later one extends the one before (token-in); the samples score back to the sampling logprobs
    under the HF model."""
    model, tok = hf
    first = rollout.turns[0]
    rendered = (renderer or Renderer(tok)).render(turn_messages(rollout, 0), tools)
    assert first.prompt_ids == rendered
    for k, turn in enumerate(rollout.turns):
        sampled = [c for p, cs in wire.seen if p == turn.prompt_ids for c in cs]
        assert (turn.completion_ids, turn.completion_logprobs) in sampled, k
        if k:
            before = rollout.turns[k - 1]
            assert turn.prompt_ids[: len(before.prompt_ids) + len(before.completion_ids)] == (
                before.prompt_ids + before.completion_ids
            )
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
