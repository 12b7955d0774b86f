"""Messages between the orchestrator and the trainer (msgspec Structs, msgpack on the wire).

Invariant: every message carries a `Header` naming its run, step and rank; a receiver rejects a
message whose run id is not its own, so two runs sharing a port cannot mix their data.

Per-token arrays travel as raw little-endian bytes (int32 ids, uint8 masks, float32 values) rather
than lists of Python numbers: encoding is a memory copy, and the trainer wraps them as tensors
without a per-token loop.
"""

from __future__ import annotations

import msgspec
import numpy as np

ID_DTYPE = np.dtype("<i4")
MASK_DTYPE = np.dtype("u1")
FLOAT_DTYPE = np.dtype("<f4")


class Header(msgspec.Struct, frozen=True):
    """Identifies a message: which run, which step and which trainer rank it is for."""

    run_id: str
    step: int
    rank: int = 0


class TrainingSample(msgspec.Struct):
    """One trainable sequence: prompt and completion tokens, with the rollout's advantage and reward.

    `completion_mask` is 0 for tokens the policy did not sample (tool or user turns of a multi-turn
    rollout, merged into one sequence); `completion_logprobs` are the sampling logprobs from
    inference, one per completion token.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int]
    completion_logprobs: list[float]
    advantage: float
    reward: float
    env_name: str
    example_id: int | str = 0
    policy_version: int = 0
    temperature: float = 1.0
    token_advantages: list[float] = []
    """Per completion token, added to `advantage` (on-policy distillation); empty: none."""

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def validate(self) -> None:
        n = len(self.completion_ids)
        if len(self.completion_mask) != n or len(self.completion_logprobs) != n:
            raise ValueError(
                f"training sample of env '{self.env_name}', example {self.example_id!r}: completion_ids, "
                f"completion_mask and completion_logprobs must have equal lengths, got {n}, "
                f"{len(self.completion_mask)} and {len(self.completion_logprobs)}"
            )
        if self.token_advantages and len(self.token_advantages) != n:
            raise ValueError(
                f"training sample of env '{self.env_name}', example {self.example_id!r}: "
                f"{len(self.token_advantages)} token_advantages for {n} completion tokens"
            )


class TrainingBatch(msgspec.Struct, tag=True):
    """All training samples of one step, before packing (used for replays and debugging)."""

    header: Header
    samples: list[TrainingSample]


class MicroBatch(msgspec.Struct, tag=True):
    """The packed tokens of one forward/backward on one trainer rank.

    Several samples are concatenated; `sample_lens` gives their lengths in order, and position ids
    restart at 0 for each one. Per-token arrays are raw bytes; use `from_arrays` and `arrays`.
    A micro-batch with `loss_mask` all zero is filler, so that every rank runs the same number of
    micro-batches in a step.
    """

    header: Header
    index: int
    """Position of this micro-batch within its step on its rank (0-based)."""
    count: int
    """Number of micro-batches of this step on this rank."""
    input_ids: bytes
    position_ids: bytes
    loss_mask: bytes
    advantages: bytes
    logprobs: bytes
    sample_lens: list[int]
    env_names: list[str]
    """Env name of each sample, parallel to `sample_lens`."""
    temperature: float = 1.0
    """Sampling temperature of these tokens (the trainer computes logprobs at it)."""
    rewards: list[float] = []
    """Each sample's rollout reward, parallel to `sample_lens` (token-level estimators need it)."""

    @classmethod
    def from_arrays(
        cls,
        header: Header,
        index: int,
        count: int,
        input_ids: np.ndarray,
        position_ids: np.ndarray,
        loss_mask: np.ndarray,
        advantages: np.ndarray,
        logprobs: np.ndarray,
        sample_lens: list[int],
        env_names: list[str],
        temperature: float = 1.0,
        rewards: list[float] | None = None,
    ) -> MicroBatch:
        return cls(
            header=header,
            index=index,
            count=count,
            input_ids=np.ascontiguousarray(input_ids, dtype=ID_DTYPE).tobytes(),
            position_ids=np.ascontiguousarray(position_ids, dtype=ID_DTYPE).tobytes(),
            loss_mask=np.ascontiguousarray(loss_mask, dtype=MASK_DTYPE).tobytes(),
            advantages=np.ascontiguousarray(advantages, dtype=FLOAT_DTYPE).tobytes(),
            logprobs=np.ascontiguousarray(logprobs, dtype=FLOAT_DTYPE).tobytes(),
            sample_lens=list(sample_lens),
            env_names=list(env_names),
            temperature=temperature,
            rewards=[0.0] * len(sample_lens) if rewards is None else [float(r) for r in rewards],
        )

    def arrays(self) -> dict[str, np.ndarray]:
        """Per-token arrays as read-only numpy views of the message's bytes (no copy)."""
        return {
            "input_ids": np.frombuffer(self.input_ids, dtype=ID_DTYPE),
            "position_ids": np.frombuffer(self.position_ids, dtype=ID_DTYPE),
            "loss_mask": np.frombuffer(self.loss_mask, dtype=MASK_DTYPE),
            "advantages": np.frombuffer(self.advantages, dtype=FLOAT_DTYPE),
            "logprobs": np.frombuffer(self.logprobs, dtype=FLOAT_DTYPE),
        }

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids) // ID_DTYPE.itemsize

    def validate(self, seq_len: int | None = None) -> None:
        """Raise a ValueError naming the field when the micro-batch is inconsistent."""
        where = f"micro-batch {self.index} of step {self.header.step} (rank {self.header.rank})"
        n = self.num_tokens
        sizes = {
            "input_ids": len(self.input_ids) // ID_DTYPE.itemsize,
            "position_ids": len(self.position_ids) // ID_DTYPE.itemsize,
            "loss_mask": len(self.loss_mask) // MASK_DTYPE.itemsize,
            "advantages": len(self.advantages) // FLOAT_DTYPE.itemsize,
            "logprobs": len(self.logprobs) // FLOAT_DTYPE.itemsize,
        }
        bad = {k: v for k, v in sizes.items() if v != n}
        if bad or any(
            len(getattr(self, k)) % 4 for k in ("input_ids", "position_ids", "advantages", "logprobs")
        ):
            raise ValueError(f"{where}: per-token fields disagree in length: {sizes}")
        if sum(self.sample_lens) != n:
            raise ValueError(f"{where}: sample_lens add up to {sum(self.sample_lens)}, but it has {n} tokens")
        if len(self.env_names) != len(self.sample_lens):
            raise ValueError(
                f"{where}: {len(self.env_names)} env_names for {len(self.sample_lens)} samples (one per sample)"
            )
        if len(self.rewards) != len(self.sample_lens):
            raise ValueError(
                f"{where}: {len(self.rewards)} rewards for {len(self.sample_lens)} samples (one per sample)"
            )
        if seq_len is not None and n > seq_len:
            raise ValueError(f"{where}: {n} tokens is longer than seq_len = {seq_len}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"{where}: index must be in [0, count = {self.count})")


Message = TrainingBatch | MicroBatch
"""Everything the transports carry."""

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes | memoryview) -> Message:
    return _decoder.decode(data)
