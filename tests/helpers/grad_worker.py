"""Run under torchrun (or plain python for 1 rank): accumulate one global batch's gradients.

argv: model_path out_file split [gae]. With 2 ranks, rank 0 takes samples[:split] and rank 1 the rest,
each packed into its own micro-batches (the poorer rank gets filler micro-batches). Rank 0 saves the
full (unsharded) gradients and the per-token metrics reduced over the ranks. With "gae", the
estimator is GAE with a critic, KL in the reward and batch whitening (all reduced over ranks), and
the critic's gradients are saved too.
"""

import random
import sys

import torch
import torch.distributed as dist

from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.dist import close_world, exit_rank, init_world
from prime_rl.trainer.trainer import Trainer
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


def main() -> None:
    model_path, out_file, split = sys.argv[1], sys.argv[2], int(sys.argv[3])
    gae = sys.argv[4:] == ["gae"]
    world = init_world()
    samples = make_samples()
    if world.distributed:
        samples = samples[:split] if world.rank == 0 else samples[split:]
    mbs = pack(samples, SEQ_LEN, 1, "grad", 0)[0] if samples else []
    count = torch.tensor(len(mbs))
    if world.distributed:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    while len(mbs) < int(count):
        mbs.append(pack([], SEQ_LEN, 1, "grad", 0)[0][0])
    config = TrainerConfig(
        model={"name": model_path},
        seq_len=SEQ_LEN,
        # No clipping or masking: every token contributes, so any normalization error shows.
        loss={"clip_low": 1e9, "clip_high": 1e9, "mask_low": 0.0, "mask_high": 1e30},
        **(
            {
                "advantage": {"type": "gae", "gamma": 0.9, "lam": 0.8, "batch_normalize": "all"},
                "kl_reward": {"beta": 0.05, "estimator": "k3"},
            }
            if gae
            else {}
        ),
    )
    torch.manual_seed(0)
    trainer = Trainer(config, world)
    acc = trainer.accumulate(mbs)
    global_tokens, metrics = acc.global_tokens, acc.stats.reduce(world)
    grads = {}
    modules = [("", trainer.model)] + ([("critic.", trainer.critic)] if gae else [])
    for prefix, module in modules:
        for name, p in module.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[prefix + name] = g.detach().clone()
    if world.is_main:
        torch.save({"grads": grads, "global_tokens": global_tokens, "local_mbs": len(mbs),
                    "metrics": {**metrics, **acc.metrics}},
                   out_file)  # fmt: skip
    close_world(world)
    exit_rank(world, 0)


if __name__ == "__main__":
    main()
