"""A fake GPU for a CPU-only machine: a device whose tensors hold no data, on which the trainer's
CUDA path runs as it would on CUDA (`trainer/gpu/dry_run.py` drives it). It stands with the
ranks and devices, below the model, which places a dry run's weights on it (`model.place`).

The GPU is torch's spare PrivateUse1 device registered as `fakegpu` (`install_fake_gpu`): a CPU-only
torch cannot give CUDA tensors gradients, since its autograd engine asks the CUDA runtime for
streams, but it lets Python register another device as an accelerator. Under `FakeMode` (torch's
FakeTensorMode) every op computes its result's shape on the meta device and labels it with this
device; the device module and a small C++ device guard answer what FSDP2 and the autograd engine ask
of a device (streams, events, RNG state). `FakeMode` applies CUDA's device rules, and
`cuda_attention` picks attention's kernel as CUDA would, so memory counts are a GPU's.

Invariant: a real run never imports this module, and the registration lasts for the process: dry
runs run in a process of their own (the CLI, the tests) or after other dry runs (plan-memory).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

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
            raise RuntimeError("the fake GPU compiles a small C++ device guard: install g++ (or set CXX)")
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src, out = Path(tmp) / "guard.cpp", Path(tmp) / "guard.so"
            src.write_text(_GUARD_SOURCE)
            cmd = [
                compiler,
                "-O1",
                "-shared",
                "-fPIC",
                "-std=c++17",
                f"-I{root / 'include'}",
                str(src),
                f"-L{root / 'lib'}",
                "-lc10",
                f"-Wl,-rpath,{root / 'lib'}",
                "-o",
                str(out),
            ]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(
                    f"compiling the fake GPU's device guard failed: {done.stderr.strip()[-500:]}"
                )
            out.replace(lib)  # atomic: concurrent dry runs share the file
    ctypes.CDLL(str(lib)).prime_rl_register_fake_gpu_guard()


_JOINS = (torch.ops.aten.cat.default, torch.ops.aten.stack.default)


class FakeMode(FakeTensorMode):
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
        if query.device.type == FAKE_GPU:
            out = _fused_kernel(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
            if out is not None:
                return out
        return sdpa(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )

    return attention


def _fused_kernel(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """The output of the fused kernel CUDA would pick (`cuda_attention`), None for its math kernel."""
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
    return None


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
