"""Reward-model scoring: what the orchestrator's batching costs against the model's own forward pass.

    uv run python benchmarks/reward_model.py [--rollouts 512] [--rounds 3]

Scores the same sum-digits conversations (one step's worth of rollouts) three ways, in one process:
- the limit: `RewardModel.score` called directly on chunks of `batch_size` (no event loop, no thread);
- the orchestrator's path: every rollout's rubric call awaits one `Batcher` at once, as concurrent
  rollouts do, and the batches run in the scorer's worker thread;
- unbatched: the same path with batch_size 1 (one forward pass per rollout).
It prints the best of `rounds` for each and the ratios to the limit, and the event loop's worst lag
while the orchestrator's path ran (its forward passes must not stall the loop).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from sum_digits import preference_pairs

from prime_rl.model.reward import load_reward_model
from prime_rl.orchestrator.envs.reward_model import RewardModels, reward_function
from prime_rl.orchestrator.rewards.reward_model import RewardModelReward

MODEL = "models/sum_digits-rm"


async def through_batcher(config: RewardModelReward, convs) -> tuple[float, float]:
    models = RewardModels()
    func = reward_function(models.batcher(config, "bench"))
    lags, done = [], False

    async def probe():
        while not done:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)

    probing = asyncio.create_task(probe())
    t0 = time.perf_counter()
    await asyncio.gather(*(func(prompt=p, completion=c) for p, c in convs))
    elapsed = time.perf_counter() - t0
    done = True
    await probing
    await models.aclose()
    return elapsed, max(lags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    pairs = preference_pairs(args.rollouts // 2, seed=7)
    convs = [
        (p["prompt"], [{"role": "assistant", "content": p[k]}]) for p in pairs for k in ("chosen", "rejected")
    ]
    rm = load_reward_model(MODEL, threads=1)

    def direct() -> float:
        t0 = time.perf_counter()
        for i in range(0, len(convs), args.batch_size):
            rm.score(convs[i : i + args.batch_size])
        return time.perf_counter() - t0

    batched = RewardModelReward(type="reward_model", path=MODEL, batch_size=args.batch_size)
    single = RewardModelReward(type="reward_model", path=MODEL, batch_size=1)
    limit = min(direct() for _ in range(args.rounds))
    runs = [asyncio.run(through_batcher(batched, convs)) for _ in range(args.rounds)]
    best, lag = min(r[0] for r in runs), max(r[1] for r in runs)
    one = min(asyncio.run(through_batcher(single, convs))[0] for _ in range(args.rounds))
    n = len(convs)
    print(f"{n} conversations, batch_size {args.batch_size}, 1 torch thread, best of {args.rounds}")
    print(f"  direct forward passes (limit):  {limit:.3f} s  ({n / limit:.0f} conv/s)")
    print(
        f"  orchestrator path, batched:     {best:.3f} s  ({best / limit:.2f}x the limit); loop lag max {lag * 1000:.1f} ms"
    )
    print(
        f"  orchestrator path, batch 1:     {one:.3f} s  ({one / limit:.2f}x the limit, {one / best:.1f}x batched)"
    )


if __name__ == "__main__":
    main()
