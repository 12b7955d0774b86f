"""How the trainer's ranks share the work (`[trainer.parallel]`), and the checks of those settings
that need nothing but the config."""

from __future__ import annotations

from pydantic import Field

from prime_rl.config import BaseConfig


class ParallelConfig(BaseConfig):
    """How the trainer ranks share the work: dp x cp = all ranks (torchrun's nproc x nodes)."""

    cp: int = Field(default=1, ge=1)
    """Context-parallel ranks per data-parallel replica: each micro-batch's tokens are split across
    this many ranks (attention all-gathers keys and values). It must divide the number of ranks;
    the data-parallel size is ranks / cp, which is the orchestrator's `trainer_ranks`."""

    ep: int = Field(default=1, ge=1)
    """Expert-parallel ranks (mixture-of-experts models only): each MoE layer's experts are split
    across this many consecutive ranks, and every token travels to its experts' ranks and back by
    all-to-all. It must divide the ranks (dp x cp) and each layer's number of experts; it does not
    change the data-parallel size. The experts' shards are replicated over ranks / ep groups
    (FSDP shards them there, as it shards everything else over all ranks)."""


def check_cp_fits(seq_len: int, cp: int) -> None:
    if seq_len < 2 * cp:
        raise ValueError(
            f"parallel.cp = {cp} cuts each micro-batch into {2 * cp} chunks: seq_len = {seq_len} must be at least that"
        )


def check_ep_fits(ep: int, model_name: str) -> None:
    """ValueError when expert parallelism cannot split `model_name` (a local folder: a dense model,
    or experts that ep does not divide); a hub id is checked when the model loads."""
    if ep == 1:
        return
    from prime_rl.model.local import num_experts, read_config

    try:
        local = read_config(model_name) is not None
    except ValueError:
        return  # the model key's own check says what is wrong with the folder
    experts = num_experts(model_name) if local else None
    if experts == 0:
        raise ValueError(
            f"parallel.ep = {ep} splits a mixture of experts, but model.name = '{model_name}' "
            "is a dense model (no experts to split): set ep = 1"
        )
    if experts and experts % ep:
        raise ValueError(
            f"parallel.ep = {ep} does not divide the {experts} experts per layer of model.name = '{model_name}'"
        )
