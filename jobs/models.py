"""Built-in models over variable-length 2-D samples ``x [batch, rows, features]`` with a row mask.

The contract every model (built-in or a user's ``model._target_``) follows::

    Model(in_features=..., num_classes=..., **config)  # constructor
    model(x [B, L, F] float, mask [B, L] bool)          # -> logits [B, num_classes]

Padding rows (mask False) must not change the output; both models here pool with a masked mean.
A model that supports activation checkpointing has ``enable_activation_checkpointing()``; one that
``parallelism.strategy=fsdp`` can shard has ``fsdp_units()`` (or the config names its block class).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


def masked_mean(h: Tensor, mask: Tensor) -> Tensor:
    """Mean over real rows: h [B, L, D], mask [B, L] -> [B, D]; a sample with 0 rows gives zeros."""
    weights = mask.to(h.dtype).unsqueeze(-1)  # [B, L, 1]
    total = (h * weights).sum(dim=1)  # [B, D]
    return total / weights.sum(dim=1).clamp_min(1.0)


class _Checkpointable(nn.Module):
    """Runs ``self.blocks`` in order, recomputing their activations in backward when enabled."""

    blocks: nn.ModuleList

    def __init__(self) -> None:
        super().__init__()
        self.activation_checkpointing = False

    def enable_activation_checkpointing(self) -> None:
        self.activation_checkpointing = True

    def fsdp_units(self) -> list[nn.Module]:
        """What ``parallelism.strategy=fsdp`` shards one by one: each block (the embedding and head
        go with the root)."""
        return list(self.blocks)

    def run_blocks(self, h: Tensor, *extra: Tensor) -> Tensor:
        for block in self.blocks:
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                h = checkpoint(block, h, *extra, use_reentrant=False)
            else:
                h = block(h, *extra)
        return h


class _ResidualMlpBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, dim * 2), nn.GELU(), nn.Linear(dim * 2, dim))

    def forward(self, h: Tensor) -> Tensor:
        return h + self.ff(self.norm(h))


class RowPoolingMLP(_Checkpointable):
    """Embed each row, masked-mean over rows, then residual MLP blocks and a linear head."""

    def __init__(self, in_features: int, num_classes: int, hidden_dim: int = 64,
                 num_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(in_features, hidden_dim), nn.GELU())
        self.blocks = nn.ModuleList(_ResidualMlpBlock(hidden_dim) for _ in range(num_layers))
        self.head = nn.Linear(hidden_dim, num_classes)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        pooled = masked_mean(self.embed(x), mask)  # [B, H]
        return self.head(self.run_blocks(pooled))  # [B, C]


class _EncoderBlock(nn.Module):
    def __init__(self, d_model: int, num_heads: int, ff_dim: int, dropout: float) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model, num_heads, ff_dim, dropout, batch_first=True,
                                                norm_first=True)

    def forward(self, h: Tensor, padding: Tensor) -> Tensor:
        return self.layer(h, src_key_padding_mask=padding)


class RowTransformer(_Checkpointable):
    """A small transformer encoder over the rows of a sample, then a masked mean and a head."""

    def __init__(self, in_features: int, num_classes: int, d_model: int = 64, num_heads: int = 4,
                 num_layers: int = 2, ff_dim: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Linear(in_features, d_model)
        self.blocks = nn.ModuleList(_EncoderBlock(d_model, num_heads, ff_dim, dropout)
                                    for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        if x.shape[1] == 0:  # a batch of 0-row samples: one masked-out zero row keeps shapes valid
            x = x.new_zeros(x.shape[0], 1, x.shape[2])
            mask = mask.new_zeros(mask.shape[0], 1)
        # A sample with 0 rows would make attention all-masked (NaN): give it one masked-in zero row
        # for attention only; masked_mean still ignores it.
        empty = ~mask.any(dim=1)  # [B]
        attend = mask.clone()
        if bool(empty.any()) and mask.shape[1] > 0:
            attend[empty, 0] = True
        h = self.run_blocks(self.embed(x), ~attend)  # [B, L, D]
        return self.head(masked_mean(self.norm(h), mask))
