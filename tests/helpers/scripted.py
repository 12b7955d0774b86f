"""Play a v1 env's group with scripted model replies: the orchestrator's own path (seats, token-in
turns, scoring), with a sampler that answers from a list instead of a model."""

import asyncio
import itertools

from prime_rl.engine.sampling import Completion, SamplingArgs
from prime_rl.orchestrator.envs.renderer import Renderer
from prime_rl.orchestrator.envs.v1_env import load_v1_env


class Scripted:
    """Answers the k-th call with `replies[k]` (the last one from then on), ending the turn as a
    model does (its end-of-turn token)."""

    def __init__(self, renderer: Renderer, replies: list[str], version: int | None = None, routes=None):
        self.renderer, self.replies, self.version, self.routes, self.prompts = (
            renderer,
            replies,
            version,
            routes,
            [],
        )

    async def sample(self, prompt_ids, args, n=1):
        text = self.replies[min(len(self.prompts), len(self.replies) - 1)]
        self.prompts.append(list(prompt_ids))
        tok = self.renderer.tokenizer
        ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
        return [
            Completion(ids, [-0.25] * len(ids), text, "stop", version=self.version, routes=self.routes)
            for _ in range(n)
        ]

    async def close(self):
        pass


def play(
    env_id: str,
    replies: list[str],
    model: str,
    row: int = 0,
    size: int = 1,
    routes=None,
    env=None,
    merge: bool = True,
    **args,
):
    """The rollouts of one group of `env_id` (taskset config `args`, or the loaded `env`) whose model
    says `replies` (with MoE `routes` on every call); without `merge`, each rollout's first turn is a
    call of its own (so the rollouts of a group can say different things)."""
    owned = env is None  # an env loaded here is closed here (its tool host, if any, with it)
    env = env or load_v1_env(env_id, args)
    task = next(itertools.islice(env.tasks(), row, None))
    renderer = Renderer.for_model(model)
    sampler = Scripted(renderer, replies, routes=routes)
    args = SamplingArgs(max_tokens=32)

    async def group():
        try:
            return await env.run_group(
                task, task.data.idx, size, sampler, renderer, "m", args, env_id, 0, [], 30, merge
            )
        finally:
            if owned:
                await env.close()

    return asyncio.run(group()), task
