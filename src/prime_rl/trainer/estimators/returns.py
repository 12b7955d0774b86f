"""Returns and advantages over the model tokens of packed samples: pure tensor functions.

Invariant: only model tokens (loss mask 1) take part. Each sample's model tokens are laid out as one
row of a [samples, width] grid in their order, so environment tokens between turns neither carry
reward nor count in the discount, and a sample's returns never leak into its neighbour's. Every
function takes and returns packed [T] tensors and is 0 outside the loss mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prime_rl.trainer.batch import sample_index


@dataclass(frozen=True)
class TokenGrid:
    """Where each token of a packed micro-batch sits in the [samples, width] grid.

    Shapes depend on `sample_lens` only, never on the mask's values, so building and reading the
    grid needs no device-to-host copy (a GPU sync); tokens outside the mask are parked in an extra
    column that nothing reads."""

    mask: torch.Tensor
    """Bool [T]: the model tokens."""
    rows: torch.Tensor
    """[T] sample index of each token."""
    cols: torch.Tensor
    """[T] index of each model token among its sample's model tokens (`width` for other tokens)."""
    num_samples: int
    width: int
    """The longest sample's length: room for any sample's model tokens."""

    @classmethod
    def of(cls, loss_mask: torch.Tensor, sample_lens: list[int]) -> TokenGrid:
        device = loss_mask.device
        lens = torch.tensor(sample_lens, device=device)
        sample_of_token = sample_index(sample_lens, device)
        counts = torch.cumsum(loss_mask.long(), 0)
        before_sample = torch.cumsum(lens, 0) - lens  # first token of each sample
        start = torch.where(before_sample > 0, counts[(before_sample - 1).clamp(min=0)], 0)
        position = counts - 1 - start[sample_of_token]
        width = max(sample_lens, default=0)
        cols = torch.where(loss_mask, position, width)
        return cls(loss_mask, sample_of_token, cols, len(sample_lens), width)

    def to_grid(self, values: torch.Tensor) -> torch.Tensor:
        grid = values.new_zeros(self.num_samples, self.width + 1)
        grid.index_put_((self.rows, self.cols), torch.where(self.mask, values, 0), accumulate=True)
        return grid[:, : self.width]

    def from_grid(self, grid: torch.Tensor) -> torch.Tensor:
        padded = torch.cat([grid, grid.new_zeros(self.num_samples, 1)], dim=1)
        return padded[self.rows, self.cols]

    def valid(self) -> torch.Tensor:
        """Bool grid: which cells hold a model token."""
        return self.to_grid(self.mask.to(torch.float32)) > 0

    def last_token(self) -> torch.Tensor:
        """Bool [T]: the last model token of each sample."""
        nxt = torch.zeros(self.num_samples, self.width + 1, dtype=torch.bool, device=self.mask.device)
        nxt[:, : self.width] = self.valid()
        is_last = nxt[:, :-1] & ~nxt[:, 1:]
        return self.from_grid(is_last.to(torch.float32)) > 0


def terminal_rewards(grid: TokenGrid, per_sample: torch.Tensor) -> torch.Tensor:
    """[T]: each sample's value on its last model token, 0 elsewhere."""
    return torch.where(grid.last_token(), per_sample.to(torch.float32)[grid.rows], 0.0)


def discounted_returns(grid: TokenGrid, rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1}, over each sample's model tokens."""
    r = grid.to_grid(rewards.to(torch.float32))
    g = torch.zeros_like(r)
    running = r.new_zeros(grid.num_samples)
    for j in range(grid.width - 1, -1, -1):
        running = r[:, j] + gamma * running
        g[:, j] = running
    return grid.from_grid(g)


def gae(
    grid: TokenGrid, rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) by generalized advantage estimation (Schulman et al. 2016):
    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last model token is 0),
    A_t = delta_t + gamma * lam * A_{t+1}, returns_t = A_t + V_t."""
    r = grid.to_grid(rewards.to(torch.float32))
    v = grid.to_grid(values.to(torch.float32))
    # Cells past a sample's end hold 0, so V_{t+1} there is 0: the episode ended.
    next_v = torch.cat([v[:, 1:], v.new_zeros(grid.num_samples, 1)], dim=1)
    delta = r + gamma * next_v - v
    adv = torch.zeros_like(r)
    running = r.new_zeros(grid.num_samples)
    for j in range(grid.width - 1, -1, -1):
        running = delta[:, j] + gamma * lam * running
        adv[:, j] = running
    advantages = grid.from_grid(adv)
    return advantages, advantages + values.to(torch.float32) * grid.mask
