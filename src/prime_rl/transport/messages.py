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

from prime_rl.transport.contract import OrchestratorSide

ID_DTYPE = np.dtype("<i4")
MASK_DTYPE = np.dtype("u1")
FLOAT_DTYPE = np.dtype("<f4")
ROUTE_DTYPES = {"u1": np.dtype("u1"), "u2": np.dtype("<u2")}
"""Expert ids of routes: one byte each up to 256 experts per layer, two above."""


def route_dtype(num_experts: int) -> str:
    """The smallest route dtype that holds expert ids below `num_experts`."""
    return "u1" if num_experts <= 256 else "u2"


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
    policy_end: int | None = None
    """The policy version at the rollout's last completion (None: not known); with `policy_version`,
    the span of policies that sampled it."""
    temperature: float = 1.0
    token_advantages: list[float] = []
    """Per completion token, a term added to the trainer's advantages after normalization (a
    teacher's distillation term, weight included); empty: none."""
    routes: bytes = b""
    """A MoE model's routed experts, as the sampler chose them, for every token: [tokens, layers,
    top-k] expert ids of `route_dtype`, raw bytes; empty: none (a dense model, or routes off)."""
    route_shape: list[int] = []
    """[layers, top-k] of `routes` (empty without routes)."""
    route_dtype: str = "u1"
    """dtype of `routes`' entries: 'u1' (up to 256 experts) or 'u2'."""

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def route_array(self) -> np.ndarray | None:
        """`routes` as a [tokens, layers, top-k] view, or None."""
        if not self.routes:
            return None
        return np.frombuffer(self.routes, dtype=ROUTE_DTYPES[self.route_dtype]).reshape(
            len(self), *self.route_shape
        )

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
        if self.routes:
            width = ROUTE_DTYPES[self.route_dtype].itemsize * int(np.prod(self.route_shape or [0]))
            if len(self.route_shape) != 2 or len(self.routes) != len(self) * width:
                raise ValueError(
                    f"training sample of env '{self.env_name}', example {self.example_id!r}: {len(self.routes)} "
                    f"bytes of routes do not fit {len(self)} tokens x route_shape {self.route_shape} of {self.route_dtype}"
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

    Credit assignment travels as separate fields, each with one meaning: the rollout's scalar
    `advantages` and its `rewards` per sample, and per-token `token_advantages` (distillation); the
    trainer composes them in one place (`trainer/rl/credit.py`).
    """

    header: Header
    index: int
    """Position of this micro-batch within its step on its rank (0-based)."""
    count: int
    """Number of micro-batches of this step on this rank."""
    input_ids: bytes
    position_ids: bytes
    loss_mask: bytes
    logprobs: bytes
    """Sampling logprobs from inference, per token (0 on tokens the policy did not sample)."""
    sample_lens: list[int]
    env_names: list[str]
    """Env name of each sample, parallel to `sample_lens`."""
    advantages: list[float]
    """Each sample's rollout advantage (the orchestrator's advantage function), parallel to `sample_lens`."""
    rewards: list[float]
    """Each sample's rollout reward, parallel to `sample_lens` (token-level estimators need it)."""
    temperature: float = 1.0
    """Sampling temperature of these tokens (the trainer computes logprobs at it)."""
    token_advantages: bytes = b""
    """Per token, a term the trainer adds to its advantages after normalization: a teacher's
    distillation term on sampled tokens, 0 elsewhere. Empty: none in this micro-batch."""
    routes: bytes = b""
    """Per token, the sampler's routed experts ([layers, top-k] ids of `route_dtype`) for router
    replay; empty: none in this micro-batch (the trainer's routers choose)."""
    route_shape: list[int] = []
    """[layers, top-k] of `routes`."""
    route_dtype: str = "u1"
    """dtype of `routes`' entries: 'u1' or 'u2'."""
    orchestrator: OrchestratorSide | None = None
    """The sender's side of the run contract, checked by the trainer (`prime_rl.transport.contract`)."""
    filler: bool = False
    """A filler micro-batch: one pad sample with no loss token, sent so that every rank runs the
    same number of micro-batches; nothing in it is a real sample."""
    policy_spans: list[tuple[int, int]] = []
    """Each sample's policy span (the version at dispatch, at its last completion), parallel to
    `sample_lens`; empty: not known (an SFT or reward-model batch)."""

    @classmethod
    def from_arrays(
        cls,
        header: Header,
        index: int,
        count: int,
        input_ids: np.ndarray,
        position_ids: np.ndarray,
        loss_mask: np.ndarray,
        logprobs: np.ndarray,
        sample_lens: list[int],
        env_names: list[str],
        advantages: list[float] | None = None,
        rewards: list[float] | None = None,
        temperature: float = 1.0,
        token_advantages: np.ndarray | None = None,
        orchestrator: OrchestratorSide | None = None,
        routes: np.ndarray | None = None,
        filler: bool = False,
        policy_spans: list[tuple[int, int]] | None = None,
    ) -> MicroBatch:
        zeros = [0.0] * len(sample_lens)
        route_fields = {}
        if routes is not None:
            dtype = next(k for k, v in ROUTE_DTYPES.items() if v == routes.dtype)
            route_fields = {
                "routes": np.ascontiguousarray(routes).tobytes(),
                "route_shape": list(routes.shape[1:]),
                "route_dtype": dtype,
            }
        return cls(
            header=header,
            index=index,
            count=count,
            input_ids=np.ascontiguousarray(input_ids, dtype=ID_DTYPE).tobytes(),
            position_ids=np.ascontiguousarray(position_ids, dtype=ID_DTYPE).tobytes(),
            loss_mask=np.ascontiguousarray(loss_mask, dtype=MASK_DTYPE).tobytes(),
            logprobs=np.ascontiguousarray(logprobs, dtype=FLOAT_DTYPE).tobytes(),
            sample_lens=list(sample_lens),
            env_names=list(env_names),
            advantages=zeros if advantages is None else [float(a) for a in advantages],
            rewards=zeros if rewards is None else [float(r) for r in rewards],
            temperature=temperature,
            token_advantages=b""
            if token_advantages is None
            else np.ascontiguousarray(token_advantages, dtype=FLOAT_DTYPE).tobytes(),
            orchestrator=orchestrator,
            filler=filler,
            policy_spans=[(int(a), int(b)) for a, b in policy_spans or []],
            **route_fields,
        )

    def arrays(self) -> dict[str, np.ndarray]:
        """Per-token arrays as read-only numpy views of the message's bytes (no copy);
        'token_advantages' and 'routes' ([T, layers, top-k]) only when the micro-batch has them."""
        out = {
            "input_ids": np.frombuffer(self.input_ids, dtype=ID_DTYPE),
            "position_ids": np.frombuffer(self.position_ids, dtype=ID_DTYPE),
            "loss_mask": np.frombuffer(self.loss_mask, dtype=MASK_DTYPE),
            "logprobs": np.frombuffer(self.logprobs, dtype=FLOAT_DTYPE),
        }
        if self.token_advantages:
            out["token_advantages"] = np.frombuffer(self.token_advantages, dtype=FLOAT_DTYPE)
        if self.routes:
            out["routes"] = np.frombuffer(self.routes, dtype=ROUTE_DTYPES[self.route_dtype]).reshape(
                -1, *self.route_shape
            )
        return out

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
            "logprobs": len(self.logprobs) // FLOAT_DTYPE.itemsize,
        }
        if self.token_advantages:
            sizes["token_advantages"] = len(self.token_advantages) // FLOAT_DTYPE.itemsize
        bad = {k: v for k, v in sizes.items() if v != n}
        if bad or any(
            len(getattr(self, k)) % 4 for k in ("input_ids", "position_ids", "logprobs", "token_advantages")
        ):
            raise ValueError(f"{where}: per-token fields disagree in length: {sizes}")
        if self.routes:
            width = ROUTE_DTYPES.get(self.route_dtype, np.dtype("u1")).itemsize * int(
                np.prod(self.route_shape or [0])
            )
            if (
                self.route_dtype not in ROUTE_DTYPES
                or len(self.route_shape) != 2
                or len(self.routes) != n * width
            ):
                raise ValueError(
                    f"{where}: {len(self.routes)} bytes of routes do not fit {n} tokens x route_shape "
                    f"{self.route_shape} of {self.route_dtype!r}"
                )
        if sum(self.sample_lens) != n:
            raise ValueError(f"{where}: sample_lens add up to {sum(self.sample_lens)}, but it has {n} tokens")
        for name in ("env_names", "advantages", "rewards"):
            if len(getattr(self, name)) != len(self.sample_lens):
                raise ValueError(
                    f"{where}: {len(getattr(self, name))} {name} for {len(self.sample_lens)} samples (one per sample)"
                )
        if self.policy_spans and len(self.policy_spans) != len(self.sample_lens):
            raise ValueError(
                f"{where}: {len(self.policy_spans)} policy_spans for {len(self.sample_lens)} samples (one per sample, or none)"
            )
        if seq_len is not None and n > seq_len:
            raise ValueError(f"{where}: {n} tokens is longer than seq_len = {seq_len}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"{where}: index must be in [0, count = {self.count})")


BYTES_PER_TOKEN_BOUND = 8192
"""More than a micro-batch ever encodes per token: 17 bytes of per-token arrays (ids, positions,
logprobs and token advantages at 4 bytes, the loss mask at 1), MoE routes of at most ~2 KiB (2-byte
expert ids x ~100 layers x top-10, beyond the largest models' shapes) and, as every sample has a
token, one sample's entries (its length, advantage and reward, 9 bytes each, and its env's name).
A dense model's micro-batch is ~18 bytes a token: this is 4x the worst case, 450x the usual one."""
MESSAGE_BYTES_FLOOR = 16 * 2**20
"""No limit below this (the Hello, tiny test runs)."""


def max_message_bytes(seq_len: int) -> int:
    """The most bytes a message to a trainer of `seq_len` may take: a bound on its receiving socket
    (zmq drops a connection that sends more, before reading the message into memory) and a check
    of the orchestrator's, whose seq_len is at most the trainer's."""
    return max(MESSAGE_BYTES_FLOOR, seq_len * BYTES_PER_TOKEN_BOUND)


class Hello(msgspec.Struct, tag=True):
    """The orchestrator's first message to each trainer rank, sent as it starts (before any
    rollout): its side of the run contract, so that a trainer whose config cannot work with it
    stops at once rather than at the first step (`prime_rl.transport.contract`)."""

    header: Header
    orchestrator: OrchestratorSide


Message = TrainingBatch | MicroBatch | Hello
"""Everything the transports carry."""

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes | memoryview) -> Message:
    return _decoder.decode(data)
