"""Publish the weights after each step as an HF folder that inference loads, or broadcast them.

Layout: `<output_dir>/weights/step_<N>/` (the weights after N optimizer steps): `model.safetensors`,
`config.json`, the tokenizer files, and `READY`, written last. Invariant: a folder with `READY` is
complete, so a reader never loads half-written weights. Gathering the full state dict is a
collective on every rank; only rank 0 writes, in a background thread, so training goes on while
the file is written (the next publish first waits for the previous write). The gathered weights
are copied into one of two host buffers kept across steps (one being filled while the other may
still be written), not into fresh memory each time: on one machine, a fresh copy of a 200 MB model
cost training ~100 ms per step in page faults, against ~16 ms for a copy into memory already
mapped. With a `Broadcaster`
(collective mode) that thread pushes the weights to the servers instead and the folder holds only
`BROADCAST` and `READY`; if the push fails, it writes the files after all, so no step goes unpublished.

With LoRA (`trainer.lora`) a step folder holds the adapter only, in peft's format that vLLM loads
(`adapter_config.json`, `adapter_model.safetensors`), and `READY`: only the adapter's parameters
are gathered, so a step moves megabytes instead of the whole model.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from prime_rl.runtime.disk import writing
from prime_rl.runtime.layout import (
    BROADCAST,
    READY,
    TRAINER_STATS,
    WEIGHTS,
    marked_steps,
    step_dir,
    weights_root,
    write_manifest,
)
from prime_rl.trainer import lora as lora_files
from prime_rl.trainer.config import LoRAConfig
from prime_rl.trainer.parallel.dist import World
from prime_rl.trainer.weights.broadcast import Broadcaster, BroadcastError

log = logging.getLogger(__name__)


class Publisher:
    def __init__(
        self,
        output_dir: Path,
        model_name: str,
        world: World,
        keep: int,
        broadcaster: Broadcaster | None = None,
        lora: LoRAConfig | None = None,
    ):
        self.root = weights_root(output_dir)
        self.model_name = model_name
        self.lora = lora
        self.broadcaster = broadcaster if world.is_main else None
        self.world = world
        self.keep = keep
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish")
        self._pending: Future | None = None
        self._staging: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
        self._next_slot = 0
        self._tokenizer = None
        if world.is_main:
            from transformers import AutoTokenizer

            self.root.mkdir(parents=True, exist_ok=True)
            self._tokenizer = AutoTokenizer.from_pretrained(model_name)
        self.last_write_s = 0.0
        self.last_broadcast = None
        """1.0 if the last finished publish was broadcast, 0.0 if it fell back to files, None before
        the first one finishes or without broadcast."""

    def publish(self, model: torch.nn.Module, step: int, stats: dict[str, float] | None = None) -> float:
        """Start publishing `step` (with the trainer's `stats` of the step that made it, for the
        orchestrator); returns the seconds training was blocked."""
        t0 = time.perf_counter()
        state = self._gather(model)
        if self.world.is_main:
            self.wait()
            self._pending = self._pool.submit(self._write, step, state, model.config, stats)
        return time.perf_counter() - t0

    def save(self, model: torch.nn.Module, path: Path) -> None:
        """Write the model as an HF folder at `path` now (a collective: call it on every rank)."""
        state = self._gather(model, staged=False)  # written before training goes on: no copy needed
        if self.world.is_main:
            self._write_folder(Path(path), state, model.config)

    def _gather(self, model: torch.nn.Module, staged: bool = True) -> dict[str, torch.Tensor]:
        """The full weights on rank 0 ({} elsewhere), as inference loads them. `staged`: copied into
        the next staging buffer, so that training may change the parameters while they are written."""
        options = StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.lora is not None
        )
        state = get_model_state_dict(model, options=options)
        if not self.world.is_main:
            return {}
        state = {k: v.detach() for k, v in state.items()}
        if self.lora is not None:
            state = lora_files.adapter_tensors(state)
        elif getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # shared with the embedding; HF ties it on load
        if not staged:
            return {k: v.to("cpu").contiguous() for k, v in state.items()}
        return self._stage(state)

    def _stage(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of `state` in the next of the two staging buffers. The other one may still be
        read by the write in flight: `publish` waits for that write only after this copy."""
        buffer = self._staging[self._next_slot]
        self._next_slot ^= 1
        for name in set(buffer) - set(state):
            del buffer[name]
        for name, tensor in state.items():
            held = buffer.get(name)
            if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
                held = buffer[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            held.copy_(tensor)
        return {name: buffer[name] for name in state}

    def _write_folder(
        self, path: Path, state: dict[str, torch.Tensor], config, stats: dict | None = None
    ) -> None:
        with writing(path, "the weights for inference"):
            if path.exists():
                shutil.rmtree(path)
            path.mkdir(parents=True)
            if self.lora is not None:
                lora_files.write_adapter(path, state, self.lora, base=self.model_name)
            else:
                save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
                config.save_pretrained(path)
                self._tokenizer.save_pretrained(path)
            if stats:
                (path / TRAINER_STATS).write_text(json.dumps(stats))
            write_manifest(path, WEIGHTS)  # keyed: nobody else's weights pass for this step's
            (path / READY).touch()

    def _write(self, step: int, state: dict[str, torch.Tensor], config, stats: dict | None = None) -> None:
        t0 = time.perf_counter()
        if self.broadcaster is not None:
            try:
                pushed = self.broadcaster.push(step, state)
                folder = step_dir(self.root, step)
                folder.mkdir(parents=True, exist_ok=True)
                (folder / BROADCAST).write_text(
                    json.dumps(
                        {"servers": pushed.servers, "seconds": pushed.seconds, "phases": pushed.phases}
                    )
                )
                if stats:
                    (folder / TRAINER_STATS).write_text(json.dumps(stats))
                (folder / READY).touch()
                self.last_broadcast = 1.0
            except BroadcastError as e:
                log.warning("%s; writing the weights of step %d to files instead", e, step)
                self._write_folder(step_dir(self.root, step), state, config, stats)
                self.last_broadcast = 0.0
        else:
            self._write_folder(step_dir(self.root, step), state, config, stats)
        for old in marked_steps(self.root, READY)[: -self.keep]:
            shutil.rmtree(step_dir(self.root, old), ignore_errors=True)
        self.last_write_s = time.perf_counter() - t0

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def close(self) -> None:
        self.wait()
        self._pool.shutdown()
