"""Token-in turns: each turn's prompt extends the tokens the model saw, whatever the chat template does
to history, so a multi-turn rollout trains as one sample; the turns whose re-rendered history would
have differed are counted.

The template here rewrites history as Qwen3's does: the generation prompt opens the assistant turn
with an empty think block, and earlier assistant turns are re-rendered without it. Re-rendering the
conversation (the classic path) breaks the prefix at every turn: one sample per turn, each repeating
the context."""

import asyncio

import pytest

from fake_server import MODEL
from helpers.templates import QWEN3_LIKE, THINK, renderer_with
from prime_rl.engine.sampling import Completion, SamplingArgs
from prime_rl.orchestrator.envs.renderer import Renderer
from prime_rl.orchestrator.envs.v1_env import load_v1_env
from prime_rl.orchestrator.loop.samples import rollout_to_samples, segments, turn_stats


@pytest.fixture
def rewriting_renderer(tmp_path) -> Renderer:
    return renderer_with(MODEL, QWEN3_LIKE, tmp_path / "tokenizer")


class Scripted:
    """A sampler answering every turn with `reply` and the end of the turn (as a model would)."""

    def __init__(self, renderer: Renderer, reply: str = "hi"):
        self.renderer, self.reply, self.prompts = renderer, reply, []

    async def sample(self, prompt_ids, args, n=1):
        self.prompts.append(list(prompt_ids))
        tok = self.renderer.tokenizer
        ids = [*tok.encode(self.reply, add_special_tokens=False), tok.eos_token_id]
        return [Completion(ids, [-0.25] * len(ids), self.reply, "stop", version=7) for _ in range(n)]

    async def close(self):
        pass


def five_turn_rollouts(renderer: Renderer, size: int = 2):
    env = load_v1_env("turns-env", {"turns": 5, "num_examples": 3})
    sampler = Scripted(renderer)
    rollouts = asyncio.run(
        env.run_group(
            env.first, 0, size, sampler, renderer, "m", SamplingArgs(max_tokens=8), "turns", 3, [], 30
        )
    )
    return rollouts, sampler


def test_a_five_turn_rollout_under_a_history_rewriting_template_is_one_sample(rewriting_renderer):
    rollouts, sampler = five_turn_rollouts(rewriting_renderer)
    for r in rollouts:
        assert not r.failed and len(r.turns) == 5
        # Every turn's prompt starts with the previous turn's prompt and completion ...
        for a, b in zip(r.turns, r.turns[1:], strict=False):
            assert (
                b.prompt_ids[: len(a.prompt_ids) + len(a.completion_ids)] == a.prompt_ids + a.completion_ids
            )
        # ... so the rollout is one sample, holding each turn's tokens once: O(turns) tokens.
        assert turn_stats(r).samples == 1 and len(segments(r)) == 1
        (sample,) = rollout_to_samples(r, 1.0)
        last = r.turns[-1]
        assert len(sample) == len(last.prompt_ids) + len(last.completion_ids)
        assert sum(sample.completion_mask) == sum(len(t.completion_ids) for t in r.turns)
        # Re-rendering the history would have broken the prefix at each of the four later turns,
        # and trained five samples of the repeated context.
        assert r.drifted_turns == 4
        rerendered = sum(len(t.prompt_ids) + len(t.completion_ids) for t in r.turns)
        assert rerendered > 2.5 * len(sample)
        # Each turn says which policy finished it; the rollout spans dispatch (3) to completion (7).
        assert [t.version for t in r.turns] == [7] * 5 and r.policy_span == (3, 7)
    # The group's identical first turns went as one request (n = 2): 1 + 4 + 4 prompts.
    assert len(sampler.prompts) == 9


def test_a_template_that_keeps_history_drifts_nowhere():
    rollouts, _ = five_turn_rollouts(Renderer.for_model(MODEL))
    assert all(r.drifted_turns == 0 and turn_stats(r).samples == 1 for r in rollouts)


def test_the_bridge_renders_only_the_new_messages(rewriting_renderer):
    r = rewriting_renderer
    previous = r.render([{"role": "user", "content": "x"}])
    completion = [*r.tokenizer.encode("hi", add_special_tokens=False), r.tokenizer.eos_token_id]
    bridged = r.bridge(previous, completion, [{"role": "user", "content": "again"}])
    assert bridged[: len(previous) + len(completion)] == previous + completion
    assert r.decode(bridged[len(previous) + len(completion) :]) == "\nuser\nagain\nassistant\n" + THINK
    # A completion cut by max_tokens (no end of turn sampled) gets the whole close of the turn.
    cut = r.bridge(previous, completion[:-1], [{"role": "user", "content": "again"}])
    assert cut[len(previous) + len(completion) - 1] == r.tokenizer.eos_token_id


def test_the_step_shows_what_token_in_kept_from_drifting(rewriting_renderer):
    from prime_rl.orchestrator.loop.records import turn_metrics
    from prime_rl.orchestrator.loop.step_metrics import drift_part

    rollouts, _ = five_turn_rollouts(rewriting_renderer)
    m = turn_metrics("turns", rollouts)
    assert m["drifted_turns/turns"] == 4.0 and m["samples_per_rollout/turns"] == 1.0
    assert m["policy_span/turns/mean"] == 4.0  # dispatched at 3, finished at 7
    assert drift_part(m, ["turns"]) == " | history drift per rollout: turns 4.00 (kept one sample)"
    kept, _ = five_turn_rollouts(Renderer.for_model(MODEL))
    assert drift_part(turn_metrics("turns", kept), ["turns"]) == ""  # nothing to say
