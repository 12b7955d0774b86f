"""Expert parallelism: each rank of an expert-parallel group holds 1/ep of every MoE layer's experts,
and each token travels to the ranks of its top-k experts and back by all-to-all.

Invariants:
- A sharded layer computes what the unsharded layer computes: the router stays replicated and runs
  on every rank's own tokens (so router replay, the load metrics and the load-balancing loss see
  nothing different), every (token, expert) pair is computed once, on the expert's rank, and the
  routing weight is applied back on the token's rank, so the router's gradient stays local.
- The experts' parameters are DTensors sharded along the expert dimension over the "ep" dimension of
  `World.ep_mesh`; FSDP shards them further over its "edp" dimension. Their full shape never
  changes, so full state dicts (published weights) and checkpoints (torch.distributed.checkpoint,
  which reshards on load) are the same for every ep, and a run may resume with another ep.
- Gradients: a rank's expert shard receives the gradient of every token of its group that reached
  it, and FSDP averages it over the "edp" group only (ranks / ep), where it averages the rest of the
  model over all ranks; the trainer undoes each average by the size of the parameter's own FSDP
  group (`model.fsdp_group_size`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single

from prime_rl.trainer.moe.replay import routers
from prime_rl.trainer.parallel.dist import World

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
"""The 3-D expert parameters of transformers' fused experts modules ([experts, 2 x width, hidden] and
[experts, hidden, width]), the layout this module knows how to shard."""


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that hold a MoE layer's experts, in layer order (transformers names them
    `*Experts`)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


def ep_problem(model: torch.nn.Module, ep: int) -> str | None:
    """Why `model`'s experts cannot be split over `ep` ranks, or None."""
    name = type(model).__name__
    if not routers(model):
        return f"{name} is a dense model (it has no experts to split)"
    found = experts_modules(model)
    unknown = [m for m in found if not all(getattr(m, w, None) is not None for w in EXPERT_WEIGHTS)]
    if not found or unknown:
        kind = type(unknown[0]).__name__ if unknown else "no experts module"
        return (
            f"the experts of {name} ({kind}) are not stored as the fused 3-D tensors "
            f"{' and '.join(EXPERT_WEIGHTS)} that expert parallelism splits"
        )
    experts = found[0].num_experts
    if experts % ep:
        return f"{name} has {experts} experts per layer, which ep = {ep} does not divide"
    return None


def shard_experts(model: torch.nn.Module, world: World) -> list[torch.nn.Module]:
    """Split every experts module of `model` over the rank's expert-parallel group (in place) and
    return the modules, for FSDP to shard over the "edp" dimension (`fsdp_experts`)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    found = experts_modules(model)
    for module in found:
        for name in EXPERT_WEIGHTS:
            full = getattr(module, name)
            sharded = distribute_tensor(full.data, world.ep_mesh["ep"], [Shard(0)])
            setattr(module, name, torch.nn.Parameter(sharded, requires_grad=full.requires_grad))
        module.forward = _dispatching_forward(module, world.ep_group, world.ep)
    return found


def fsdp_experts(modules: list[torch.nn.Module], world: World, reshard_after_forward: bool) -> None:
    """FSDP over the copies of each expert shard (the "edp" dimension)."""
    from torch.distributed.fsdp import fully_shard

    # (A gradient divide factor other than FSDP's group size would need PREMUL_SUM, which gloo lacks:
    # the trainer rescales instead, see the module docstring.)
    for module in modules:
        fully_shard(module, mesh=world.ep_mesh["edp"], reshard_after_forward=reshard_after_forward)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def _dispatching_forward(module: torch.nn.Module, group: dist.ProcessGroup, ep: int):
    experts = module.num_experts
    per_rank = experts // ep

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        hidden = hidden_states.shape[-1]
        k = top_k_index.shape[1]
        chosen = top_k_index.reshape(-1)
        # (token, slot) pairs in expert order: then each destination rank's pairs are contiguous.
        order = torch.argsort(chosen, stable=True)
        token = order // k
        sent_per_expert = torch.bincount(chosen, minlength=experts)
        got_per_expert = torch.empty_like(sent_per_expert)
        dist.all_to_all_single(got_per_expert, sent_per_expert, group=group)
        got_per_expert = got_per_expert.view(ep, per_rank)  # [source rank, local expert]
        # The split sizes must be host numbers (one copy of 2 x ep + per_rank counts per layer).
        send, got = sent_per_expert.view(ep, per_rank).sum(1), got_per_expert.sum(1)
        send_splits, got_splits, per_local = (t.tolist() for t in (send, got, got_per_expert.sum(0)))
        inputs = hidden_states[token]
        arrived = all_to_all_single(
            inputs.new_empty(sum(got_splits), hidden), inputs, got_splits, send_splits, group=group
        )
        # What arrived is grouped by source rank, then local expert: regroup by local expert.
        local_id = torch.repeat_interleave(
            torch.arange(per_rank, device=arrived.device).repeat(ep), got_per_expert.reshape(-1)
        )
        by_expert = torch.argsort(local_id, stable=True)
        out = _expert_ffn(module, arrived[by_expert], per_local)
        out = torch.empty_like(out).index_copy(0, by_expert, out)
        returned = all_to_all_single(
            out.new_empty(sum(send_splits), hidden), out, send_splits, got_splits, group=group
        )
        weighted = returned * top_k_weights.reshape(-1)[order, None].to(returned.dtype)
        return torch.zeros_like(hidden_states).index_add(0, token, weighted.to(hidden_states.dtype))

    return forward


def _expert_ffn(module: torch.nn.Module, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each local expert's gated MLP on its contiguous block of `rows` (`counts` rows each)."""
    gate_up, down = _local(module.gate_up_proj), _local(module.down_proj)
    outs = []
    for e, block in enumerate(rows.split(counts)):
        if block.shape[0] == 0:
            continue
        gate, up = F.linear(block, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(module.act_fn(gate) * up, down[e]))
    if not outs:
        # No token of the group chose this rank's experts. The empty result must still depend on
        # `rows` and the weights: the backward of the all-to-all that brought `rows` is a collective
        # the other ranks enter, and the experts' gradients are reduced over their copies.
        return rows.new_zeros(0, down.shape[1]) + 0 * (rows.sum() + gate_up.sum() + down.sum())
    return torch.cat(outs)
