"""Run under torchrun (or plain python for 1 rank): accumulate one global batch's gradients.

argv: model_path RUN [+ RUN]..., each RUN being out_file split [gae] [lora] [cp=N] [ep=N] [steps=N]
[agg=MODE] [norm=MODE] [filtered] [halves]. The runs go one after the other in the same processes, each with a
fresh trainer: one interpreter start and one process group for all of them (so cp and ep are the same
in every run).

With data-parallel ranks, rank 0 takes samples[:split] and the others deal the rest in turn, each
packed into its own micro-batches (the poorer rank gets filler micro-batches). With cp=N, each
data-parallel rank is N context-parallel ranks sharing its micro-batches. With ep=N, a MoE model's
experts are split over N ranks. agg=MODE: the loss aggregation. Rank 0 saves the full (unsharded)
gradients and the per-token metrics reduced over the ranks. With "gae", the estimator is GAE with a
critic, KL in the reward and batch whitening (all reduced over ranks), and the critic's gradients are
saved too. With steps=N, it trains N optimizer steps (a fresh global batch each) and saves the
parameters before and after, and each step's metrics. With "lora", the policy (and the critic's body)
train rank-4 adapters: only trained parameters are saved. norm=MODE: the advantages'
batch_normalize. With "filtered", every rollout of the step was filtered: each rank gets one filler
micro-batch, trains one step, and rank 0 saves its metrics and whether any parameter changed.
With "halves", one step of two mini-batches (`mini_batches = 2`, the loss's ratio to the sampler)
against a fresh trainer's two steps on each rank's first and second half of its micro-batches: rank
0 saves whether the parameters are equal to the bit, and both steps' metrics.
"""

import random
import sys

import torch
import torch.distributed as dist

from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.parallel.dist import World, close_world, exit_rank, init_world
from prime_rl.trainer.rl.trainer import Trainer
from prime_rl.transport.messages import TrainingSample
from prime_rl.transport.packing import pack

SEQ_LEN = 128


def make_samples(n: int = 12, seed: int = 0) -> list[TrainingSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, c = rng.randint(4, 30), rng.randint(2, 40)
        out.append(
            TrainingSample(
                prompt_ids=[rng.randrange(3, 500) for _ in range(p)],
                completion_ids=[rng.randrange(3, 500) for _ in range(c)],
                completion_mask=[1] * c,
                completion_logprobs=[-rng.uniform(4.0, 8.0) for _ in range(c)],
                advantage=rng.uniform(-1, 1),
                reward=rng.choice([0.0, 0.5, 1.0]),
                env_name=rng.choice(["a", "b"]),
            )
        )
    return out


def rank_micro_batches(world, split: int, seed: int, filtered: bool = False) -> list:
    """This data-parallel rank's share of the global batch of `seed`, padded with filler micro-batches
    to the count of the richest rank."""
    samples = [] if filtered else make_samples(seed=seed)
    if world.dp > 1 and samples:  # rank 0 takes the first `split`, the other ranks deal the rest in turn
        samples = (
            samples[:split] if world.dp_rank == 0 else samples[split:][world.dp_rank - 1 :: world.dp - 1]
        )
    # (an empty step still reaches every rank: one filler micro-batch, as `pack` sends it)
    mbs = pack(samples, SEQ_LEN, 1, "grad", seed)[0] if samples or filtered else []
    count = torch.tensor(len(mbs))
    if world.distributed:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    while len(mbs) < int(count):
        mbs.append(pack([], SEQ_LEN, 1, "grad", seed)[0][0])
    return mbs


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def layout(options: list[str]) -> tuple[int, int]:
    """(cp, ep) of a run's options."""
    cp = next((int(o[3:]) for o in options if o.startswith("cp=")), 1)
    ep = next((int(o[3:]) for o in options if o.startswith("ep=")), 1)
    return cp, ep


def run(world: World, model_path: str, out_file: str, split: int, options: list[str]) -> None:
    """One run: a fresh trainer on this process's world; rank 0 writes `out_file`."""
    gae, lora = "gae" in options, "lora" in options
    cp, ep = layout(options)
    steps = next((int(o[6:]) for o in options if o.startswith("steps=")), 0)
    aggregation = next((o[4:] for o in options if o.startswith("agg=")), "token-mean")
    normalize = next((o[5:] for o in options if o.startswith("norm=")), None)
    filtered, halves = "filtered" in options, "halves" in options
    config = TrainerConfig(
        model={"name": model_path, "logprob_chunk_tokens": 48},
        parallel={"cp": cp, "ep": ep},
        seq_len=SEQ_LEN,
        lora={"rank": 4, "alpha": 8.0} if lora else None,
        # Adam's per-entry normalization makes an entry whose gradient is float rounding take a
        # learning-rate-sized step of random sign; an eps above such entries keeps every step
        # proportional to its gradient, so parameters after N steps compare the gradients' agreement.
        optim={"lr": 1e-3, "eps": 1e-3},
        # No clipping or masking: every token contributes, so any normalization error shows.
        loss={
            "clip_low": 1e9,
            "clip_high": 1e9,
            "mask_low": 0.0,
            "mask_high": 1e30,
            "aggregation": aggregation,
        },
        **(
            {
                "advantage": {"type": "gae", "gamma": 0.9, "lam": 0.8, "batch_normalize": "all"},
                "kl_reward": {"beta": 0.05, "estimator": "k3"},
            }
            if gae
            else {}
        ),
        **({"advantage": {"batch_normalize": normalize}} if normalize else {}),
    )
    torch.manual_seed(0)
    trainer = Trainer(config, world)
    modules = [("", trainer.model)] + ([("critic.", trainer.critic)] if gae else [])
    if steps:  # train `steps` optimizer steps and save the parameters
        before = {
            prefix + n: full(p) for prefix, m in modules for n, p in m.named_parameters() if p.requires_grad
        }
        history = [
            trainer.train_step(rank_micro_batches(world, split, seed), seed)[0] for seed in range(steps)
        ]
        after = {
            prefix + n: full(p) for prefix, m in modules for n, p in m.named_parameters() if p.requires_grad
        }
        if lora:  # publish the adapter, gathered from every rank, beside the output file
            from pathlib import Path

            from prime_rl.trainer.weights.publish import Publisher

            publisher = Publisher(
                Path(out_file).parent / "published", model_path, world, keep=1, lora=config.lora
            )
            publisher.publish(trainer.model, steps)
            publisher.close()
        if world.is_main:
            torch.save({"before": before, "after": after, "metrics": history}, out_file)
        return
    if halves:
        mbs = rank_micro_batches(world, split, 0)
        assert len(mbs) >= 2, "two mini-batches need two micro-batches on every rank"
        torch.manual_seed(0)
        two = Trainer(config.model_copy(update={"mini_batches": 2}), world)
        metrics, _ = two.train_step(mbs)
        trainer.train_step(mbs[: len(mbs) // 2])
        trainer.train_step(mbs[len(mbs) // 2 :])
        pairs = zip(two.model.parameters(), trainer.model.parameters(), strict=True)
        same = all(torch.equal(full(a), full(b)) for a, b in pairs)
        if world.is_main:
            torch.save({"same": same, "metrics": metrics, "local_mbs": len(mbs)}, out_file)
        return
    if filtered:
        before = [full(p) for p in trainer.model.parameters()]
        metrics, _ = trainer.train_step(rank_micro_batches(world, split, 0, filtered=True))
        changed = any(
            not torch.equal(b, full(p)) for b, p in zip(before, trainer.model.parameters(), strict=True)
        )
        if world.is_main:
            torch.save({"metrics": metrics, "changed": changed}, out_file)
        return
    mbs = rank_micro_batches(world, split, 0)
    acc = trainer.accumulate(mbs)
    global_tokens, metrics = acc.totals.loss_tokens, acc.metrics
    grads = {
        prefix + n: full(p.grad) for prefix, m in modules for n, p in m.named_parameters() if p.requires_grad
    }
    if world.is_main:
        torch.save({"grads": grads, "global_tokens": global_tokens, "local_mbs": len(mbs),
                    "metrics": metrics},
                   out_file)  # fmt: skip


def main() -> None:
    model_path, args = sys.argv[1], sys.argv[2:]
    runs, start = [], 0
    for end in [i for i, a in enumerate(args) if a == "+"] + [len(args)]:
        out_file, split, *options = args[start:end]
        runs.append((out_file, int(split), options))
        start = end + 1
    layouts = {layout(options) for _, _, options in runs}
    assert len(layouts) == 1, f"the runs of one launch share cp and ep, not {layouts}"
    world = init_world(*layouts.pop())
    for out_file, split, options in runs:
        run(world, model_path, out_file, split, options)
    close_world(world)
    exit_rank(world, 0)


if __name__ == "__main__":
    main()
