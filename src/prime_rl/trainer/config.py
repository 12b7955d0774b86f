"""Configuration of the trainer (`uv run trainer`); SFT and reward-model training have their own
(`sft/config.py`, `reward_model/config.py`) and share the sections defined here."""

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from prime_rl.config import BaseConfig, RootConfig
from prime_rl.config.defaults import DEFAULT_MAX_STEPS, DEFAULT_OUTPUT_DIR, DEFAULT_SEQ_LEN
from prime_rl.model.config import ModelConfig
from prime_rl.model.local import check_model_name
from prime_rl.runtime.monitor import WandbConfig
from prime_rl.trainer.estimators.config import EstimatorConfig, Reinforce
from prime_rl.trainer.losses.config import LossConfig, PPOLoss, RolloutCorrectionConfig
from prime_rl.trainer.moe.config import MoEConfig
from prime_rl.trainer.parallel.config import ParallelConfig, check_cp_fits, check_ep_fits
from prime_rl.transport.config import TransportConfig
from prime_rl.transport.contract import Setting, TrainerSide


class TrainedModelConfig(ModelConfig):
    """The model being trained (loaded with transformers)."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype (float32 gives exact logprob parity with vLLM in float32)."""

    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward: activation memory of one layer instead
    of all of them, for about a third more compute (figures in docs/trainer.md, "Memory")."""

    logprob_chunk_tokens: int | None = Field(default=None, ge=1)
    """Tokens whose logits exist at once when computing logprobs and entropy, in forward and backward:
    memory is about this x vocabulary x 8 bytes instead of micro-batch tokens x vocabulary x 16.
    Unset: as many as make 2^25 logits (220 tokens at a 151,936 vocabulary, 128 MB a copy)."""

    reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters after forward (less memory, one more all-gather in backward)."""

    attention: Literal["auto", "packed", "flex", "varlen", "dense"] = "auto"
    """How the samples packed in a micro-batch attend, each to itself only. 'packed' (CPU and CUDA):
    samples of similar length padded into a few batched sdpa calls, work = the sum of their L²;
    'flex' (CUDA): FlexAttention with a block mask; 'varlen' (CUDA, bfloat16): variable-length
    flash attention; 'dense': transformers' sdpa with a [T, T] mask of the micro-batch (work T²).
    'auto': 'packed', or 'dense' for a model whose attention cannot be swapped (sliding windows).
    Context parallelism needs 'packed'."""


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every linear layer of a Qwen/Llama-style decoder block (attention and MLP), not the lm_head."""

ATTENTION_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
"""The default targets of a mixture of experts, whose experts are 3-D tensors, not linear layers."""


class LoRAConfig(BaseConfig):
    """Train low-rank adapters (LoRA, with peft) instead of the full weights: W stays frozen and the
    trained layers compute W x + (alpha / rank) B A x. Only A and B are trained, kept in optimizer
    state, checkpointed and published (`weights/step_<N>/` then holds vLLM's adapter format), and
    the orchestrator samples from the served adapter. The output layer and the embeddings are never
    trained fully: vLLM serves an adapter of linear layers only."""

    rank: int = Field(default=16, ge=1)
    """The adapter's rank r: A is r x in, B is out x r."""

    alpha: float = Field(default=32.0, gt=0)
    """Scale numerator: the update is (alpha / rank) B A. With alpha proportional to rank, a change of
    rank keeps the step size about the same."""

    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training. Anything but 0 makes the trainer's logprobs
    differ from the sampler's (vLLM applies no dropout), which the importance ratio then corrects for."""

    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1)
    """Linear layers that get adapters, by the last part of their name (e.g. 'q_proj' adapts every
    layer's attention query). Each must name a linear layer of the model. Default: every linear layer
    of the blocks; of a mixture of experts, the attention's (q, k, v, o_proj)."""


class OptimizerConfig(BaseConfig):
    """AdamW settings."""

    lr: float = Field(default=1e-4, gt=0)
    """Peak learning rate."""

    weight_decay: float = Field(default=0.0, ge=0)
    """Decoupled weight decay."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW beta1 and beta2."""

    eps: float = Field(default=1e-8, gt=0)
    """AdamW epsilon: gradient entries much smaller than it get steps proportional to them rather
    than of the learning rate's size."""

    max_norm: float = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this value."""


class SchedulerConfig(BaseConfig):
    """Learning-rate schedule."""

    type: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the decay after warmup."""

    warmup_steps: int = Field(default=0, ge=0)
    """Steps of linear warmup from 0 to the peak learning rate."""

    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Final learning rate as a fraction of the peak (linear and cosine)."""


class CheckpointConfig(BaseConfig):
    """Trainer checkpoints (model, optimizer, scheduler, step, RNG) for resuming."""

    interval: int | None = Field(default=None, ge=1)
    """Save every this many steps; unset disables checkpoints."""

    keep: int = Field(default=2, ge=1)
    """Keep only the last this many checkpoints."""

    resume_step: int | None = None
    """Resume from this step; -1 means the latest checkpoint; unset starts fresh."""


class CriticConfig(BaseConfig):
    """The value model of `advantage.type = "gae"`: an HF causal LM's body with a scalar head, trained
    beside the policy with a clipped value loss and its own optimizer."""

    path: str | None = None
    """HF causal LM folder whose body starts the critic; unset: the policy's model. The value head
    always starts fresh (seeded, the same on every rank)."""

    @field_validator("path")
    @classmethod
    def _local_folder_exists(cls, name: str | None) -> str | None:
        return None if name is None else check_model_name(name)

    optim: OptimizerConfig = OptimizerConfig()
    """The critic's AdamW (constant learning rate)."""

    warmup_steps: int = Field(default=0, ge=0)
    """The first this many steps train only the critic: the policy is not updated."""

    value_clip: float = Field(default=0.2, gt=0)
    """A new value may move at most this far from the value it had when the step began (PPO's
    clipped value loss)."""


class KLRewardConfig(BaseConfig):
    """KL to the frozen starting model as a per-token reward, -beta * KL(policy || reference), added
    before advantages (PPO-RLHF). Unlike `loss.kl_coef`, which differentiates a KL term in the loss,
    this penalty is part of the return the policy gradient follows, and discounting and the critic
    see it."""

    beta: float = Field(default=0.0, ge=0)
    """The (initial) penalty weight; 0 disables KL in the reward."""

    estimator: Literal["k1", "k2", "k3"] = "k1"
    """Per-token estimator of the KL from the sampling logprobs and the reference's."""

    target: float | None = Field(default=None, gt=0)
    """Adaptive controller (Ziegler et al. 2019): the KL per sample (summed over its model tokens,
    averaged over the step) to hold; unset keeps beta fixed."""

    horizon: int = Field(default=10000, ge=1)
    """Adaptive controller: each step multiplies beta by 1 + clip(kl / target - 1, -0.2, 0.2) * samples / horizon."""

    @model_validator(mode="after")
    def _adaptive_needs_a_start(self):
        if self.target is not None and self.beta <= 0:
            raise ValueError("the adaptive controller (target) multiplies beta: set beta > 0 to start from")
        return self


class PublishConfig(BaseConfig):
    """Weights published after every step for inference to load."""

    keep: int = Field(default=3, ge=1)
    """Keep only the newest this many published steps."""


class WeightBroadcastConfig(BaseConfig):
    """How the weights after each step reach the inference servers."""

    type: Literal["filesystem", "collective"] = "filesystem"
    """'filesystem': rank 0 writes `weights/step_<N>/` and the orchestrator has every server load it.
    'collective': rank 0 broadcasts the weights in memory to every server's workers through a
    torch.distributed group (gloo on CPU, NCCL on CUDA) and writes only a marker; when the group
    cannot be formed or breaks, it writes that step's files instead. Checkpoints are files either way."""

    servers: list[str] = []
    """Inference servers to broadcast to (root URLs, e.g. http://10.0.0.1:8000); `rl` fills them in."""

    follow_pool: bool = True
    """Also broadcast to the servers that joined the run's pool since it started (the orchestrator's
    members, asked before each update at the address in `<output_dir>/orchestrator/pool.json`): each
    update forms its group anew with every member that answers, so servers join and leave at step
    boundaries."""

    host: str | None = None
    """Address the servers reach trainer rank 0 at. Default: MASTER_ADDR (torchrun's address of the
    node of rank 0), else 127.0.0.1."""

    port: int = Field(default=29510, ge=1024, le=65535)
    """Port of the broadcast group's store on trainer rank 0; `rl` picks a free one on one machine."""

    timeout_s: float = Field(default=120.0, gt=0)
    """How long an update may take to form its group and to move each chunk before it fails."""

    chunk_mb: float = Field(default=32.0, gt=0)
    """Tensors travel in flat chunks of about this size: one collective per chunk, and each end works
    on one chunk (packing, loading) while the next is on the wire."""


class ExportConfig(BaseConfig):
    """Per-token export of what the loss saw (opt-in)."""

    enabled: bool = False
    """Write <output_dir>/trainer/tokens/step_<N>/rank_<r>.jsonl, one line per packed sample."""


class TrainingConfig(RootConfig):
    """What every training run shares, RL (`TrainerConfig`) and SFT (`SFTConfig`): the model, its
    parallelism and optimizer, checkpoints, published weights and logging."""

    model: TrainedModelConfig = TrainedModelConfig()
    """The model and how it is held in memory."""

    lora: LoRAConfig | None = None
    """Train LoRA adapters instead of the full weights (in RL, also the critic's body through an
    adapter of its own, its value head fully). Unset: full fine-tuning."""

    output_dir: Path = DEFAULT_OUTPUT_DIR
    """Run folder: checkpoints, published weights, metrics."""

    max_steps: int = Field(default=DEFAULT_MAX_STEPS, ge=1)
    """Number of optimizer steps."""

    seq_len: int = Field(default=DEFAULT_SEQ_LEN, ge=8)
    """Tokens per packed micro-batch; a longer sample is an error."""

    seed: int = 0
    """Seed for anything random in the trainer (e.g. fresh LoRA adapters)."""

    parallel: ParallelConfig = ParallelConfig()
    """Data, context and expert parallelism (data parallelism is torchrun's ranks / cp)."""

    dist_timeout_s: float = Field(default=300.0, gt=0)
    """Seconds a collective between the ranks waits for a peer before it fails and this rank stops with
    one line, exit status 1 (a restart can fix it): a rank that died or hung (a stuck kernel, SIGSTOP)
    stops the others within this instead of torch's 30 minutes (gloo; nccl: 10). It must outlast a
    step's longest wait on one rank's own work: the other ranks wait in a step's first collective
    while rank 0 finishes writing or broadcasting the previous step's weights (up to 140 s for 140 GB
    at 1 GB/s); raise it for larger weights or slower disks. Waits that may be longer
    have their own bounds: a cp peer's for its leader's data (this + transport.timeout_s), the
    ranks' for rank 0 verifying or writing a checkpoint (30 min). On CUDA, nccl's watchdog ends a
    rank whose GPU collective timed out (SIGABRT) without the line."""

    moe: MoEConfig = MoEConfig()
    """Mixture-of-experts models: the load-balancing loss."""

    optim: OptimizerConfig = OptimizerConfig()
    """Optimizer."""

    scheduler: SchedulerConfig = SchedulerConfig()
    """Learning-rate schedule."""

    ckpt: CheckpointConfig = CheckpointConfig()
    """Checkpoints."""

    max_nan_steps: int = Field(default=3, ge=1)
    """Consecutive steps with a non-finite loss or gradient norm (each skipped: no parameter, no
    learning-rate schedule moves) after which training stops with one line."""

    publish: PublishConfig = PublishConfig()
    """Weights published under output_dir/weights as training goes."""

    wandb: WandbConfig = WandbConfig()
    """W&B logging."""

    @model_validator(mode="after")
    def _cp_fits_the_micro_batch(self):
        check_cp_fits(self.seq_len, self.parallel.cp)
        return self

    @model_validator(mode="after")
    def _ep_splits_the_experts(self):
        check_ep_fits(self.parallel.ep, self.model.name)
        return self

    @model_validator(mode="before")
    @classmethod
    def _moe_adapters_default_to_attention(cls, data):
        lora = data.get("lora") if isinstance(data, dict) else None
        if lora is None:
            return data
        unset = "target_modules" not in (lora if isinstance(lora, dict) else lora.model_fields_set)
        model = data.get("model") or {}
        name = model.get("name", TrainedModelConfig().name) if isinstance(model, dict) else model.name
        if unset and isinstance(name, str):
            from prime_rl.model.local import num_experts

            try:
                moe = num_experts(name) > 0
            except ValueError:
                return data  # the model key's own validation says what is wrong with it
            if moe:
                targets = list(ATTENTION_TARGETS)
                lora = (
                    {**lora, "target_modules": targets}
                    if isinstance(lora, dict)
                    else lora.model_copy(update={"target_modules": targets})
                )
                return {**data, "lora": lora}
        return data


class TrainerConfig(TrainingConfig):
    """Trainer: trains the policy on the orchestrator's micro-batches and publishes its weights."""

    loss: LossConfig = PPOLoss()
    """The RL loss."""

    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    """Correction for the sampler's probabilities differing from the trainer's (truncated IS,
    IcePop token masking, sequence masking) on the behaviour ratio pi_old / mu, whatever the loss."""

    mini_batches: int = Field(default=1, ge=1)
    """Optimizer steps per batch: the step's micro-batches in this many contiguous groups, each
    normalized by its own global token count and followed by an update. With more than one, pi_old
    (the policy at the step's start) comes from a first forward without gradients, and the loss's
    clip acts from the second group on; with one, pi_old is the trainer's own logprobs, detached.
    Each update moves the weights by about the learning rate (Adam): divide it by this to move as far
    per batch (sum-digits: 4 mini-batches at lr / 4 train as one does, at lr they overshoot)."""

    advantage: EstimatorConfig = Reinforce()
    """Token-level advantage estimator."""

    critic: CriticConfig = CriticConfig()
    """The value model (used by advantage.type = 'gae')."""

    kl_reward: KLRewardConfig = KLRewardConfig()
    """KL to the starting model in the reward."""

    weight_broadcast: WeightBroadcastConfig = WeightBroadcastConfig()
    """Files or an in-memory broadcast to the inference servers."""

    export: ExportConfig = ExportConfig()
    """Token export."""

    transport: TransportConfig = TransportConfig()
    """Where micro-batches come from."""

    @model_validator(mode="after")
    def _adapters_travel_as_files(self):
        if self.lora is not None and self.weight_broadcast.type == "collective":
            raise ValueError(
                "trainer.lora: adapters are published as files (a few MB a step); "
                "set weight_broadcast.type = 'filesystem'"
            )
        return self

    @model_validator(mode="after")
    def _correction_agrees_with_the_ratio(self):
        # Every loss config, a user's included, is a LossBase: both fields are always set, so their
        # defaults ('token', 'sampler') are the ones LossBase declares.
        kind = self.rollout_correction.type
        if self.loss.ratio_type == "sequence" and kind in ("tis", "icepop"):
            raise ValueError(
                f"loss.ratio_type = 'sequence' weighs each sample by one ratio, but rollout_correction.type = "
                f"'{kind}' reweights or drops its tokens one by one: use rollout_correction.type = 'seq_mask' "
                "(or 'none') with a sequence ratio"
            )
        if self.loss.old_policy == "sampler" and kind == "tis":
            raise ValueError(
                "loss.old_policy = 'sampler' already divides the loss's ratio by the sampler's "
                "probability, and rollout_correction.type = 'tis' would weight each token by that "
                "mismatch a second time: use old_policy = 'trainer' with tis (the decoupled objective), "
                "or no tis with old_policy = 'sampler'"
            )
        return self


def contract_side(config: TrainerConfig, dp: int) -> TrainerSide:
    """The settings of this config that depend on the orchestrator's (`prime_rl.transport.contract`); `dp` is
    the number of data-parallel ranks (all ranks / cp)."""
    a = config.advantage
    return TrainerSide(
        seq_len=config.seq_len,
        dp=dp,
        needs_every_group=Setting.of("trainer.advantage.type", a.type) if a.uses_critic else None,
        normalizes=Setting.of("trainer.advantage.batch_normalize", a.batch_normalize)
        if a.batch_normalize != "none"
        else None,
    )
