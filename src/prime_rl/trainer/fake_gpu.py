"""The trainer's CUDA path run on a CPU-only machine: one real training step on a fake GPU.

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

The GPU is torch's PrivateUse1 device registered as `fakegpu` (`install_fake_gpu`): a CPU-only torch
cannot give CUDA tensors gradients, since its autograd engine asks the CUDA runtime for streams.
Attention runs as CUDA would choose its kernel (`cuda_attention`), so memory counts are a GPU's.

Invariant: a real run never imports this module, and the registration lasts for the process, so
each dry run is its own process (the CLI, the tests) or follows other dry runs (plan-memory's search).
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
from torch._subclasses.fake_tensor import FakeTensorMode

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


# --- the fake GPU: torch's PrivateUse1 device, with no kernels --------------------------------------

FAKE_GPU = "fakegpu"
"""The device type of the dry run. A CPU-only torch cannot give CUDA tensors gradients (its autograd
engine asks the CUDA runtime for streams), but it lets Python register the spare PrivateUse1
device as an accelerator with no-op streams: FakeTensorMode computes every op's result on the
meta device and labels it with this device, and the engine and FSDP2 treat it as they treat CUDA."""


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        return self

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _Stream(_Event):
    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _Event()


_DEFAULT_STREAM = _Stream()


class _FakeGpuModule:
    """`torch.fakegpu`: what FSDP2 and the trainer ask of a device module (`torch.cuda`'s names)."""

    Stream = _Stream
    Event = _Event

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, device) -> None:
        pass

    def manual_seed_all(self, seed: int) -> None:
        pass

    def current_stream(self, device=None) -> _Stream:
        return _DEFAULT_STREAM

    def default_stream(self, device=None) -> _Stream:
        return _DEFAULT_STREAM

    def stream(self, stream=None):
        return contextlib.nullcontext()

    def synchronize(self, device=None) -> None:
        pass

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    def get_rng_state(self, device=None) -> torch.Tensor:  # activation checkpointing keeps RNG states
        return torch.zeros(8, dtype=torch.uint8)

    def set_rng_state(self, state, device=None) -> None:
        pass


_GUARD_SOURCE = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
// The fake GPU's device guard: one device, one stream, events that are always complete.
namespace {
using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;
constexpr DeviceType kType = DeviceType::PrivateUse1;
struct Guard final : c10::impl::DeviceGuardImplInterface {
  static Device dev() { return Device(kType, 0); }
  static Stream stream() { return Stream(Stream::DEFAULT, dev()); }
  DeviceType type() const override { return kType; }
  Device exchangeDevice(Device) const override { return dev(); }
  Device getDevice() const override { return dev(); }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device) const noexcept override { return stream(); }
  Stream getDefaultStream(Device) const override { return stream(); }
  Stream getNewStream(Device, int) const override { return stream(); }
  Stream exchangeStream(Stream) const noexcept override { return stream(); }
  DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void** event, const Stream&, const DeviceIndex, const c10::EventFlag) const override {
    static int token;
    *event = &token;
  }
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const Stream&) const override {}
};
}  // namespace
extern "C" void prime_rl_register_fake_gpu_guard() {
  static Guard guard;
  c10::impl::registerDeviceGuard(kType, &guard);
}
"""


def _register_stream_guard() -> None:
    """Replace the Python device guard that torch registers for a Python backend with a C++ one.

    torch's Python guard implements no stream calls, and the autograd engine makes them (a stream
    guard around each backward node on an accelerator, e.g. when activation checkpointing
    recomputes a layer): from C++'s noexcept destructors, where a missing method ends the process.
    The guard is compiled once per torch version (a C++ compiler and torch's headers, well under a
    second) and cached in the user's cache folder."""
    import ctypes
    import hashlib
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    root = Path(torch.__file__).parent
    key = hashlib.sha256(f"{torch.__version__}{_GUARD_SOURCE}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "prime_rl"
    lib = cache / f"fake_gpu_guard-{key}.so"
    if not lib.exists():
        compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        if compiler is None:
            raise DryRunError(
                "the fake-GPU dry run compiles a small C++ device guard: install g++ (or set CXX)"
            )
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src, out = Path(tmp) / "guard.cpp", Path(tmp) / "guard.so"
            src.write_text(_GUARD_SOURCE)
            cmd = [compiler, "-O1", "-shared", "-fPIC", "-std=c++17", f"-I{root / 'include'}", str(src),
                   f"-L{root / 'lib'}", "-lc10", f"-Wl,-rpath,{root / 'lib'}", "-o", str(out)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise DryRunError(
                    f"compiling the fake GPU's device guard failed: {done.stderr.strip()[-500:]}"
                )
            out.replace(lib)  # atomic: concurrent dry runs share the file
    ctypes.CDLL(str(lib)).prime_rl_register_fake_gpu_guard()


_JOINS = (torch.ops.aten.cat.default, torch.ops.aten.stack.default)


class _FakeMode(FakeTensorMode):
    """FakeTensorMode as on a machine without the device: `torch.tensor(data, device=...)` builds
    its data on the CPU and moves it, as everywhere else, instead of asking the device for memory."""

    @property
    def avoid_device_init(self) -> bool:
        return True

    def dispatch(self, func, types, args=(), kwargs=None):
        # FakeTensorMode lets a 0-dim CPU tensor join any op, as CUDA's elementwise kernels do; CUDA's
        # cat and stack do not (they copy every input on the device), so neither does the dry run.
        if func in _JOINS and args:
            devices = {t.device for t in args[0] if isinstance(t, torch.Tensor)}
            if len(devices) > 1:
                from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

                first, *rest = sorted(devices, key=str)
                raise FakeTensorDeviceMismatchError(func, first, rest[0])
        return super().dispatch(func, types, args, kwargs)


def install_fake_gpu() -> torch.device:
    """Register the fake GPU with torch (once per process: the registration cannot be undone, so
    run dry runs in a process of their own) and return its device."""
    if torch._C._get_privateuse1_backend_name() != FAKE_GPU:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(FAKE_GPU, backend_module=_FakeGpuModule())
        _register_stream_guard()
    return torch.device(FAKE_GPU, 0)


# --- attention as CUDA would run it ---------------------------------------------------------------


def cuda_attention(sdpa: Callable) -> Callable:
    """`F.scaled_dot_product_attention` with CUDA's kernel choice on the fake GPU (elsewhere, `sdpa`
    itself). Without it torch would run the math kernel there, which holds every head's [L, S]
    probabilities; CUDA picks (torch 2.13, sm80+): flash attention when there is no mask, the dtype
    is half and k/v have as many heads as q (or `enable_gqa`); the memory-efficient kernel when there
    is a mask and as many heads, after turning a boolean mask into an additive one of q's dtype (a
    new [.., L, S] tensor per call, which the kernel keeps for backward); the math kernel otherwise."""

    def attention(
        query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        if query.device.type != FAKE_GPU:
            return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)  # fmt: skip
        same_heads = key.shape[-3] == query.shape[-3]
        half = query.dtype in (torch.float16, torch.bfloat16)
        if attn_mask is None and half and (same_heads or enable_gqa) and query.shape[-1] <= 256:
            if not same_heads:
                rep = query.shape[-3] // key.shape[-3]
                key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
            out = torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )
            return out[0]
        if same_heads and query.shape[-1] <= 256:
            bias = attn_mask
            if bias is not None and bias.dtype == torch.bool:
                bias = torch.where(bias, 0.0, float("-inf")).to(query.dtype)
            out = torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, query.requires_grad, dropout_p, is_causal, scale=scale
            )
            return out[0]
        return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, enable_gqa=enable_gqa)  # fmt: skip

    return attention


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


# --- models with no data ---------------------------------------------------------------------------


def materialize(module: torch.nn.Module, device: torch.device) -> None:
    """Give every parameter and buffer of a meta-device module an uninitialized (fake) tensor on
    `device`, keeping tied weights tied. Must run inside FakeTensorMode."""
    done: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                done[id(p)] = torch.nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad
                )
            m._parameters[name] = done[id(p)]
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = done.setdefault(id(b), torch.empty(b.shape, dtype=b.dtype, device=device))


# --- the error, in one line ------------------------------------------------------------------------

_LIBRARY_DIRS = tuple({os.path.dirname(os.path.dirname(torch.__file__)), os.path.dirname(os.__file__)})


def _code_line(tb) -> str:
    """`file:line (code)` of the innermost frame in the project's or the user's code; when that is
    inside the World helpers of `dist.py`, their caller's line, which is the one to fix."""
    here = os.path.abspath(__file__)
    frames = [f for f in traceback.extract_tb(tb) if os.path.abspath(f.filename) != here]
    ours = [f for f in frames if not os.path.abspath(f.filename).startswith(_LIBRARY_DIRS)]
    helper = None
    while len(ours) > 1 and ours[-1].filename.endswith(os.path.join("trainer", "dist.py")):
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

    from prime_rl.trainer.dist import arrange

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
    track_memory: bool = False,
) -> DryRunReport:
    """One training step of `config` (a TrainerConfig) on rank 0 of a fake dp x cp world, its
    micro-batches of `tokens` (default: seq_len) synthetic tokens. Raises DryRunError (one line)."""
    from prime_rl.trainer.trainer import Trainer

    device = device or install_fake_gpu()
    cp = cp or config.parallel.cp
    tokens = tokens or config.seq_len
    report = DryRunReport(dp, cp, tokens, micro_batches)
    try:
        with fake_world(dp, cp, device) as world:
            checks = collectives_on_device(device) if device.type == FAKE_GPU else contextlib.nullcontext()
            sdpa = torch.nn.functional.scaled_dot_product_attention
            with (
                _FakeMode(allow_non_fake_inputs=True),
                checks,
                objects_from_this_rank(),
                mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", cuda_attention(sdpa)),
            ):
                trainer = Trainer(config, world, loss_fn)
                batches = _micro_batches(trainer, tokens, micro_batches)
                step = config.critic.warmup_steps if trainer.critic is not None else 0
                if track_memory:
                    report.peak = _tracked_step(trainer, batches, step)
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


def _tracked_step(trainer, batches, step: int) -> dict[str, int]:
    """Bytes per category at the peak of a step after the first (so the optimizer state exists)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class Tracker(MemTracker):
        """Peak bytes by kind, without MemTracker's per-module statistics (which allow one call of
        each module per step; the trainer calls its model once per micro-batch)."""

        def track_gradients(self, module: torch.nn.Module) -> None:
            """Count the gradients of the trained parameters as gradients (MemTracker would do it
            per module call, for frozen parameters too, which cannot take a hook)."""
            for p in module.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._count_gradient)

        def _count_gradient(self, p: torch.Tensor) -> None:
            self._update_and_maybe_create_winfos(p.grad, _MemRefType.GRAD)

        def _pre_fw_hook(self, module, inputs):
            pass

        def _post_fw_hook(self, module, inputs, outputs):
            pass

        def _pre_bw_hook(self, module, args):
            pass

        def _post_bw_hook(self, module, args):
            pass

    modules = [m for m in (trainer.model, trainer.ref_model, trainer.critic) if m is not None]
    optimizers = [o for o in (trainer.optimizer, trainer.critic_optimizer) if o is not None]
    trainer.train_step(batches, step)  # AdamW allocates its state in the first step
    tracker = Tracker()
    tracker.track_external(*modules, *optimizers)
    for m in modules:
        tracker.track_gradients(m)
    with tracker:
        trainer.train_step(batches, step + 1)
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    get = lambda *kinds: sum(snapshot.get(k, 0) for k in kinds)  # noqa: E731
    return {
        "parameters": get(_MemRefType.PARAM, _MemRefType.BUFFER),
        "gradients": get(_MemRefType.GRAD),
        "optimizer": get(_MemRefType.OPT),
        "activations": get(_MemRefType.ACT, _MemRefType.TEMP, _MemRefType.OTH),
        "total": snapshot.get("Total", 0),
    }


def _each_loss(trainer, mb, config, loss_fn) -> list[str]:
    """Forward and backward of every built-in loss (and the configured plugin) on one micro-batch's
    tensors: the step itself ran only the configured one."""
    from prime_rl.trainer.loss import LossInputs, rl_loss

    t = trainer._tensors(mb)
    lp = torch.zeros_like(t["logprobs"], requires_grad=True)
    inputs = LossInputs(lp, t["logprobs"], t["advantages"], t["loss_mask"], torch.zeros_like(lp),
                        mb.sample_lens, torch.zeros_like(lp))  # fmt: skip
    variants = {
        "ppo (token ratio)": {"type": "ppo", "ratio_type": "token"},
        "ppo (gspo: sequence ratio)": {"type": "ppo", "ratio_type": "sequence"},
        "cpgd": {"type": "cpgd"},
        "ppo + kl penalty, top-entropy mask": {"type": "ppo", "kl_coef": 0.1, "top_entropy_fraction": 0.5},
    }
    done = []
    for name, overrides in variants.items():
        loss_config = config.loss.model_copy(update=overrides)
        rl_loss(inputs, loss_config).token_loss.sum().backward()
        done.append(name)
    if loss_fn is not None:
        loss_fn(inputs).token_loss.sum().backward()
        done.append("the configured plugin")
    return done


def default_ranks(cp: int) -> int:
    """The world a bare `--fake-gpu` plans: one 8-GPU node when cp divides 8, else 2 replicas."""
    return 8 if 8 % cp == 0 else 2 * cp


def main_dry_run(config, ranks: int | None, prog: str = "trainer") -> None:
    """`trainer @ cfg.toml --fake-gpu [--ranks N]`: the dry run, one line either way; exit 1 if a
    check fails, 2 if the rank count does not fit the config."""
    from prime_rl.trainer.main import load_custom_loss

    cp = config.parallel.cp
    ranks = ranks or default_ranks(cp)
    if ranks % cp:
        sys.stderr.write(f"{prog}: error: --ranks {ranks} is not a multiple of trainer.parallel.cp = {cp}\n")
        raise SystemExit(2)
    try:
        report = dry_run(config, dp=ranks // cp, cp=cp, loss_fn=load_custom_loss(config))
    except DryRunError as e:
        sys.stderr.write(f"{prog}: fake-GPU dry run failed: {e}\n")
        raise SystemExit(1) from None
    parts = [f"dp {report.dp} x cp {report.cp}"]
    if config.lora is not None:
        parts.append("LoRA")
    if config.model.activation_checkpointing:
        parts.append("activation checkpointing")
    if config.advantage.type == "gae":
        parts.append("critic")
    print(
        f"{prog}: fake-GPU dry run passed: one step of {report.micro_batches} micro-batches of "
        f"{report.tokens} tokens on rank 0 ({', '.join(parts)}); losses: {', '.join(report.losses)}"
    )
