"""The reward model's objective for the trainer's step (`trainer/step.py`): Bradley-Terry on packed
preference pairs, and the model it trains, a causal LM's body with a one-output head.

A micro-batch holds whole pairs as consecutive samples [chosen_0, rejected_0, chosen_1, ...]
(`data.pack_pairs`); a sample's score is the head's output at its last position, the one loss token
of the sample. The loss is the sum of -log sigmoid(s_chosen - s_rejected) over this rank's pairs,
divided by the number of pairs of the whole step, so the gradient is that of the mean over the
global batch however the pairs are dealt to ranks and micro-batches.

Invariants: each pair counts on exactly one rank (with context parallelism, the rank of its group
that computes the chosen sample's score; every rank of the group gathers the scores of the whole
micro-batch, and each score's gradient flows back to the rank that computed it); the head has no
bias, which the loss could never train since it sees score differences only; the saved folder is an
HF *ForSequenceClassification with one output that scores a conversation as the trained model did.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from prime_rl.runtime.disk import writing
from prime_rl.trainer import lora as lora_files
from prime_rl.trainer.batch import PackedBatch
from prime_rl.trainer.head import ScalarHead
from prime_rl.trainer.model import DTYPES, ModelLoadError, build_model
from prime_rl.trainer.optim import build_optimizer, build_scheduler
from prime_rl.trainer.parallel.context_parallel import SequenceShard
from prime_rl.trainer.parallel.dist import World, all_reduce_sum
from prime_rl.trainer.reward_model.config import RewardModelTrainConfig
from prime_rl.trainer.step import Context, Part, train_step
from prime_rl.transport.messages import MicroBatch

HEAD = "score"
"""The head's name in HF's sequence classifiers, under which the saved folder keeps its weight."""


def load_score_model(config: RewardModelTrainConfig, world: World) -> ScalarHead:
    """The body of `model.name` with a fresh head (seeded by `seed`, drawn at the body's
    `initializer_range`, no bias), placed and sharded like the trainer's policy; with `lora`, the
    body trains an adapter and the head is trained fully."""

    def score_head(body: torch.nn.Module) -> ScalarHead:
        std = float(getattr(body.config, "initializer_range", 0.02))
        return ScalarHead(body, body.config.hidden_size, bias=False, seed=config.seed, std=std)

    return build_model(
        config.model,
        world,
        key="model.name",
        role="the reward model's body",
        lora=config.lora,
        seed=config.seed,
        head=score_head,
        check=lambda model: check_classifier(model, config),
    )


class BradleyTerry:
    """The reward model, its optimizer and schedule, and the Bradley-Terry objective."""

    def __init__(self, config: RewardModelTrainConfig, world: World):
        self.config = config
        self.world = world
        self.model = load_score_model(config, world)
        self.optimizer = build_optimizer(self.model, config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.scheduler, config.max_steps)

    @property
    def parts(self) -> list[Part]:
        return [Part("", self.model, self.optimizer, self.config.optim.max_norm)]

    def pair_scores(self, b: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(every position's score [T], chosen scores [P], rejected scores [P], which pairs this rank
        counts [P] bool)."""
        shard = b.shard
        values = shard.gather(
            self.model(shard.take(b.input_ids), shard.take(b.position_ids), **shard.model_kwargs())
        )
        pairs = 0 if b.source.filler else len(b.sample_lens) // 2
        ends = torch.from_numpy(np.cumsum(b.sample_lens)[: 2 * pairs] - 1).to(values.device)
        chosen, rejected = ends[0::2], ends[1::2]
        return values, values[chosen], values[rejected], held_here(shard, values.device)[chosen]

    def prepare(self, batches: list[PackedBatch]) -> tuple[list[PackedBatch], dict[str, float]]:
        return batches, {}

    def loss(self, b: PackedBatch, ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        with ctx.routing(b) as routing:
            values, chosen, rejected, owned = self.pair_scores(b)
        per_pair, record = pair_losses(chosen - rejected, owned)
        # Every rank runs backward on every micro-batch, one without pairs too: FSDP's collectives
        # in backward must meet those of the other ranks.
        loss = per_pair.sum() / max(ctx.totals.samples / 2, 1.0) if len(per_pair) else values.sum() * 0.0
        aux = ctx.aux_loss(routing, b)
        return (loss if aux is None else loss + aux), record

    def metrics(self, records: list[torch.Tensor], ctx: Context) -> dict[str, float]:
        """The mean loss, the share of pairs scored the right way round and the mean margin
        s_chosen - s_rejected, over the step's pairs on all ranks."""
        return pair_metrics(records, self.world)

    def train_step(self, micro_batches: list[MicroBatch], step: int = 0) -> tuple[dict[str, float], list]:
        batches = [PackedBatch.of(mb, self.world) for mb in micro_batches]
        moe = (self.config.moe.replay, self.config.moe.aux_loss_coef)
        return train_step(self, batches, self.parts, self.scheduler, self.world, moe=moe)

    def evaluate(self, micro_batches: list[MicroBatch]) -> dict[str, float]:
        """`metrics` of this rank's share of held-out pairs (a collective: every rank calls it)."""
        records = []
        self.model.eval()
        with torch.no_grad():
            for mb in micro_batches:
                _, chosen, rejected, owned = self.pair_scores(PackedBatch.of(mb, self.world))
                records.append(pair_losses(chosen - rejected, owned)[1])
        self.model.train()
        return pair_metrics(records, self.world)


def held_here(shard: SequenceShard, device: torch.device) -> torch.Tensor:
    """[T] bool: the positions whose score this rank computes (all of them without context
    parallelism). The rank that scores a pair's chosen sample counts the pair."""
    if not shard.split:
        return torch.ones(shard.length, dtype=torch.bool, device=device)
    local = torch.zeros(shard.length + 1, dtype=torch.bool, device=device)
    local[shard.index] = True  # padding lands on the extra slot
    return local[: shard.length]


def pair_losses(diff: torch.Tensor, owned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each pair's loss [P], 0 for pairs another rank counts; the record [4] of (loss sum, pairs
    scored the right way round, margin sum, pairs) of the pairs this rank counts, detached)."""
    per_pair = torch.where(owned, -F.logsigmoid(diff), 0.0)
    record = torch.stack(
        [per_pair.sum(), (owned & (diff > 0)).sum(), torch.where(owned, diff, 0.0).sum(), owned.sum()]
    )
    return per_pair, record.detach().double()


def pair_metrics(records: list[torch.Tensor], world: World) -> dict[str, float]:
    local = world.scalars(0.0, 0.0, 0.0, 0.0)
    for r in records:
        local += r
    loss_sum, right, margin, pairs = world.host(all_reduce_sum(local, world))
    pairs = max(pairs, 1.0)
    return {"loss": loss_sum / pairs, "accuracy": right / pairs, "margin": margin / pairs}


def classifier_state(state: dict[str, torch.Tensor], prefix: str, lora) -> dict[str, torch.Tensor]:
    """A `ScalarHead`'s full state dict under the names of an HF sequence classifier whose body sits
    under `prefix`; LoRA adapters are folded into the weights they adapt."""
    body = {k.removeprefix("body."): v for k, v in state.items() if k.startswith("body.")}
    if lora is not None:
        base = {
            k.replace(".base_layer.", "."): v for k, v in body.items() if not lora_files.is_adapter_key(k)
        }
        body = lora_files.merge(base, lora_files.adapter_tensors(body), lora.alpha / lora.rank)
    unknown = [k for k in state if not k.startswith("body.") and k != "head.weight"]
    if unknown:
        raise ValueError(f"the reward model has parameters outside its body and head: {sorted(unknown)}")
    return {**{f"{prefix}.{k}": v for k, v in body.items()}, f"{HEAD}.weight": state["head.weight"]}


def empty_classifier(config: RewardModelTrainConfig, pad_token_id: int | None) -> torch.nn.Module:
    """`model.name`'s HF sequence classifier with one output, on the meta device (no memory: the
    trained tensors are assigned into it)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    hf_config = AutoConfig.from_pretrained(config.model.name, num_labels=1)
    if pad_token_id is not None:
        hf_config.pad_token_id = pad_token_id
    with torch.device("meta"):
        return AutoModelForSequenceClassification.from_config(hf_config, dtype=DTYPES[config.model.dtype])


def check_classifier(model: ScalarHead, config: RewardModelTrainConfig) -> None:
    """ModelLoadError unless `model` saves as `model.name`'s sequence classifier, name for name:
    found before training rather than when the trained model is saved."""
    name = config.model.name
    try:
        classifier = empty_classifier(config, None)
    except Exception as e:
        raise ModelLoadError(
            f"model.name = '{name}': transformers builds no sequence classifier for it, which the reward "
            f"model is saved as: {type(e).__name__}: {' '.join(str(e).split())}"
        ) from None
    meta = {k: torch.empty_like(v, device="meta") for k, v in model.state_dict().items()}
    ours = {k: v.shape for k, v in classifier_state(meta, classifier.base_model_prefix, config.lora).items()}
    theirs = {k: v.shape for k, v in classifier.state_dict().items()}
    if ours != theirs:
        differ = sorted(k for k in ours.keys() & theirs.keys() if ours[k] != theirs[k])
        raise ModelLoadError(
            f"model.name = '{name}': its body's weights do not map onto {type(classifier).__name__}'s "
            f"(only in the body: {sorted(ours.keys() - theirs.keys())[:5]}; only in the classifier: "
            f"{sorted(theirs.keys() - ours.keys())[:5]}; of other shapes: {differ[:5]})"
        )


def save_reward_model(
    model: ScalarHead, config: RewardModelTrainConfig, tokenizer, path: Path, world: World
) -> None:
    """Write the trained model as an HF *ForSequenceClassification folder with one output at `path`
    (a collective: every rank calls it; rank 0 writes)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not world.is_main:
        return
    classifier = empty_classifier(config, tokenizer.pad_token_id)
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    classifier.load_state_dict(
        classifier_state(state, classifier.base_model_prefix, config.lora), strict=True, assign=True
    )
    with writing(path, "the reward model"):
        path.mkdir(parents=True, exist_ok=True)
        classifier.save_pretrained(path)
        tokenizer.save_pretrained(path)
