"""`trainer --fake-gpu`: the trainer's CUDA path run on a CPU-only machine, one real step on a fake GPU.

`dry_run` builds the trainer's model(s) from their config alone (meta tensors, no weights read) and
runs `Trainer.train_step` under torch's FakeTensorMode, on tensors that carry a GPU device and hold
no data, as rank 0 of a fake process group of the planned dp x cp world (every collective returns at
once, with the right shapes). The trainer's own code runs unchanged: FSDP2 sharding over the mesh,
context-parallel attention and its collectives, chunked logprobs, activation checkpointing, the
critic, LoRA, the loss (the user's plugin when the config names one), AdamW.

What it catches, each as one line naming the op, the devices and the code line:
- an op that mixes CPU and GPU tensors, with CUDA's rules (a 0-dim CPU tensor may join an
  elementwise op; cat and stack take one device);
- a CPU tensor handed to a tensor collective, which on the CUDA plan runs on nccl;
- a device-to-host copy outside `World.host` (`.item()`, `bool(t)`, a shape sized from the data):
  a GPU sync the step did not plan for.

The GPU is `trainer/parallel/fake_gpu.py`'s. Only rank 0 runs: object collectives return its own objects, and the
step's few host copies (`World.host`) read 1.0, so it takes the branches of an ordinary step.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.distributed as dist

from prime_rl.trainer.parallel.dist import exit_now
from prime_rl.trainer.parallel.fake_gpu import FAKE_GPU, FakeMode, cuda_attention, install_fake_gpu

_TENSOR_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
)


class DryRunError(RuntimeError):
    """The step failed on the fake GPU plan; the message is one line."""


# --- collectives on the CUDA plan -------------------------------------------------------------------


class CollectiveOnCPU(RuntimeError):
    """A tensor collective got a CPU tensor where the CUDA plan runs it on nccl."""


def _tensors(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


@contextlib.contextmanager
def objects_from_this_rank() -> Iterator[None]:
    """Object collectives in a fake world: every rank is taken to hold what rank 0 holds. They carry
    Python objects over gloo (the control plane), which is not what the dry run checks."""

    def all_gather_object(output, obj, group=None):
        output[:] = [obj] * len(output)

    with (
        mock.patch.object(dist, "all_gather_object", all_gather_object),
        mock.patch.object(dist, "broadcast_object_list", lambda objects, src=None, group=None, **kw: None),
    ):
        yield


@contextlib.contextmanager
def collectives_on_device(device: torch.device) -> Iterator[None]:
    """Every tensor collective called through `torch.distributed` must get tensors on `device`
    (object collectives go through gloo on purpose and are not checked)."""

    def checked(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            for t in (t for a in (*args, *kwargs.values()) for t in _tensors(a)):
                if t.device.type != device.type:
                    raise CollectiveOnCPU(
                        f"torch.distributed.{name} got a tensor on {t.device} (shape {tuple(t.shape)}, "
                        f"{t.dtype}); on the CUDA plan it runs on nccl, which takes GPU tensors only ({device.type} here)"
                    )
            return fn(*args, **kwargs)

        return call

    with contextlib.ExitStack() as stack:
        for name in _TENSOR_COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                stack.enter_context(mock.patch.object(dist, name, checked(name, fn)))
        yield


# --- the error, in one line ------------------------------------------------------------------------

_LIBRARY_DIRS = tuple({os.path.dirname(os.path.dirname(torch.__file__)), os.path.dirname(os.__file__)})


def _code_line(tb) -> str:
    """`file:line (code)` of the innermost frame in the project's or the user's code; when that is
    inside the World helpers of `dist.py`, their caller's line, which is the one to fix."""
    from prime_rl.trainer.parallel import fake_gpu

    ours_not = {os.path.abspath(__file__), os.path.abspath(fake_gpu.__file__)}  # the dry run's machinery
    frames = [f for f in traceback.extract_tb(tb) if os.path.abspath(f.filename) not in ours_not]
    ours = [f for f in frames if not os.path.abspath(f.filename).startswith(_LIBRARY_DIRS)]
    helper = None
    while len(ours) > 1 and ours[-1].filename.endswith(os.path.join("parallel", "dist.py")):
        helper = helper or ours[-1]
        ours.pop()
    frame = (ours or frames or [None])[-1]
    if frame is None:
        return "an unknown line"
    return _where(frame) + (f", through {helper.name} ({_where(helper)})" if helper else "")


def _where(frame) -> str:
    code = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
    path = os.path.relpath(frame.filename)
    return f"{frame.filename if path.startswith('..') else path}:{frame.lineno} ({code})"


def describe(error: BaseException) -> str:
    """One line: what failed on the fake GPU plan, with the devices and the code line."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorDeviceMismatchError,
    )

    at = _code_line(error.__traceback__)
    if isinstance(error, FakeTensorDeviceMismatchError):
        devices = " and ".join(sorted({str(error.common_device), str(error.device)}))
        return f"{error.func} mixes tensors on {devices} at {at}"
    if isinstance(error, CollectiveOnCPU):
        return f"{error} at {at}"
    if isinstance(error, DataDependentOutputException):
        return (
            f"{error.func} copies a GPU value to the host at {at}: a device sync in the step; "
            "keep the value on the device or read it once through World.host"
        )
    if isinstance(error, DynamicOutputShapeException):
        return (
            f"{error.func} sizes its result from GPU data at {at}: a device sync in the step (a boolean "
            "index, nonzero, repeat_interleave without output_size); use a masked dense op or sizes known on the host"
        )
    first = " ".join(str(error).split())[:300]
    return f"{type(error).__name__}: {first} at {at}"


# --- the dry run -----------------------------------------------------------------------------------


@dataclass
class DryRunReport:
    dp: int
    cp: int
    tokens: int
    """Tokens of each micro-batch of rank 0."""
    micro_batches: int
    peak: dict[str, int] = field(default_factory=dict)
    """Bytes per category at rank 0's peak: parameters, gradients, optimizer, activations, total."""
    losses: list[str] = field(default_factory=list)
    """The losses that ran forward and backward on the step's tensors."""


def synthetic_samples(tokens: int, vocab: int, env: str = "dry-run") -> list:
    """Samples of at most 2,048 tokens (128 prompt tokens each) filling `tokens` exactly, as
    `benchmarks/memory.py` builds them; their sampling logprobs are those of a uniform policy, near
    what a random model computes, so importance ratios are near 1 and no token is masked."""
    import math
    import random

    from prime_rl.transport.messages import TrainingSample

    rng, out, left = random.Random(0), [], tokens
    while left:
        n = min(2048, left)
        p = min(128, n - 1)
        out.append(
            TrainingSample(
                [rng.randrange(3, vocab) for _ in range(p)],
                [rng.randrange(3, vocab) for _ in range(n - p)],
                [1] * (n - p),
                [-math.log(vocab)] * (n - p),
                rng.uniform(-1, 1),
                0.0,
                env,
            )
        )
        left -= n
    return out


@contextlib.contextmanager
def fake_world(dp: int, cp: int, device: torch.device):
    """Rank 0 of a dp x cp world in a fake process group (collectives return at once)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from prime_rl.trainer.parallel.dist import arrange

    if dist.is_initialized():
        raise DryRunError("a process group already exists in this process; the dry run needs its own")
    world_size = dp * cp
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield arrange(0, world_size, 0, device, cp, fake=True)
    finally:
        dist.destroy_process_group()


def dry_run(
    config,
    dp: int = 1,
    cp: int | None = None,
    micro_batches: int = 2,
    tokens: int | None = None,
    loss_fn=None,
    device: torch.device | None = None,
    measure: Callable | None = None,
) -> DryRunReport:
    """One training step of `config` (a TrainerConfig) on rank 0 of a fake dp x cp world, its
    micro-batches of `tokens` (default: seq_len) synthetic tokens. Raises DryRunError (one line).
    `measure(trainer, micro_batches, step) -> dict` runs the step instead, its result the report's
    `peak` (plan-memory counts the step's memory so)."""
    from prime_rl.trainer.rl.trainer import Trainer

    device = device or install_fake_gpu()
    cp = cp or config.parallel.cp
    tokens = tokens or config.seq_len
    report = DryRunReport(dp, cp, tokens, micro_batches)
    try:
        with fake_world(dp, cp, device) as world:
            checks = collectives_on_device(device) if device.type == FAKE_GPU else contextlib.nullcontext()
            sdpa = torch.nn.functional.scaled_dot_product_attention
            with (
                FakeMode(allow_non_fake_inputs=True),
                checks,
                objects_from_this_rank(),
                mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", cuda_attention(sdpa)),
            ):
                trainer = Trainer(config, world, loss_fn)
                batches = _micro_batches(trainer, tokens, micro_batches)
                step = config.critic.warmup_steps if trainer.critic is not None else 0
                if measure is not None:
                    report.peak = measure(trainer, batches, step)
                else:
                    trainer.train_step(batches, step)
                report.losses = _each_loss(trainer, batches[-1], config, loss_fn)
    except DryRunError:
        raise
    except Exception as e:
        raise DryRunError(describe(e)) from e
    return report


def _micro_batches(trainer, tokens: int, count: int) -> list:
    """`count` micro-batches of `tokens` synthetic tokens each, as the orchestrator packs them."""
    from prime_rl.transport.packing import pack

    vocab = trainer.model.config.vocab_size
    out = [pack(synthetic_samples(tokens, vocab), tokens, 1, "dry-run", 0)[0][0] for _ in range(count)]
    for i, mb in enumerate(out):
        mb.index, mb.count = i, count
    return out


def _each_loss(trainer, mb, config, loss_fn) -> list[str]:
    """Forward and backward of every built-in loss (and the configured plugin) on one micro-batch's
    tensors: the step itself ran only the configured one."""
    from prime_rl.trainer.batch import PackedBatch
    from prime_rl.trainer.losses import LOSSES, LossInputs, build_loss

    b = PackedBatch.of(mb, trainer.world)
    lp = torch.zeros_like(b.sampling_logprobs, requires_grad=True)
    inputs = LossInputs(
        trainer_logprobs=lp,
        sampling_logprobs=b.sampling_logprobs,
        advantages=b.per_token(b.rollout_advantages),
        loss_mask=b.loss_mask,
        entropy=torch.zeros_like(lp),
        sample_lens=b.sample_lens,
        ref_logprobs=torch.zeros_like(lp),
        sample_of_token=b.sample_of_token,
    )
    variants = {name: b.config() for name, b in LOSSES.builtins.items()}
    ppo = LOSSES.builtins["ppo"].config
    variants["ppo (gspo: sequence ratio)"] = ppo(ratio_type="sequence")
    variants["ppo + kl penalty, top-entropy mask"] = ppo(kl_coef=0.1, top_entropy_fraction=0.5)
    variants["ppo (decoupled: the ratio to pi_old)"] = ppo(old_policy="trainer")
    done = []
    for name, loss_config in variants.items():
        build_loss(loss_config)(inputs).token_loss.sum().backward()
        done.append(name)
    if loss_fn is not None or config.loss.type not in LOSSES.builtins:
        (loss_fn or trainer.loss_fn)(inputs).token_loss.sum().backward()
        done.append("the configured plugin")
    return done


def default_ranks(cp: int) -> int:
    """The world a bare `--fake-gpu` plans: one 8-GPU node when cp divides 8, else 2 replicas."""
    return 8 if 8 % cp == 0 else 2 * cp


def main_dry_run(config, ranks: int | None, prog: str = "trainer") -> None:
    """`trainer @ cfg.toml --fake-gpu [--ranks N]`: the dry run, one line either way; exit 1 if a
    check fails, 2 if the rank count does not fit the config. The process ends here (`exit_now`)."""
    cp = config.parallel.cp
    if config.parallel.ep > 1:
        sys.stderr.write(
            f"{prog}: error: the fake-GPU dry run does not model trainer.parallel.ep = {config.parallel.ep} "
            "(the all-to-all's sizes depend on the routing of real data, which fake tensors do not have); "
            "dry-run the config with ep = 1\n"
        )
        raise SystemExit(2)
    ranks = ranks or default_ranks(cp)
    if ranks % cp:
        sys.stderr.write(f"{prog}: error: --ranks {ranks} is not a multiple of trainer.parallel.cp = {cp}\n")
        raise SystemExit(2)
    try:
        report = dry_run(config, dp=ranks // cp, cp=cp)
    except DryRunError as e:
        sys.stderr.write(f"{prog}: fake-GPU dry run failed: {e}\n")
        exit_now(1)
    parts = [f"dp {report.dp} x cp {report.cp}"]
    if config.lora is not None:
        parts.append("LoRA")
    if config.model.activation_checkpointing:
        parts.append("activation checkpointing")
    if config.advantage.uses_critic:
        parts.append("critic")
    print(
        f"{prog}: fake-GPU dry run passed: one step of {report.micro_batches} micro-batches of "
        f"{report.tokens} tokens on rank 0 ({', '.join(parts)}); losses: {', '.join(report.losses)}"
    )
    exit_now(0)
