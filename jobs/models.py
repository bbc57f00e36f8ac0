"""Built-in models: two over variable-length 2-D samples ``x [batch, rows, features]`` with a row
mask (task=classify, task=regress), and a GPT over token windows (task=causal_lm).

The contract of the row models (built-in or a user's ``model._target_``)::

    Model(in_features=..., num_classes=... | num_outputs=..., **config)  # constructor
    model(x [B, L, F] float, mask [B, L] bool)          # -> [B, num_classes or num_outputs]

and of a language model::

    Model(vocab_size=..., seq_len=..., **config)
    model(tokens [B, L] int64)                          # -> logits [B, L, vocab_size]

Padding rows (mask False) must not change the output; both models here pool with a masked mean.
A model that supports activation checkpointing has ``enable_activation_checkpointing()``; one that
``parallelism.strategy=fsdp`` can shard has ``fsdp_units()`` (or the config names its block class).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


def head_size(num_classes: int | None, num_outputs: int | None) -> int:
    """The output width: classes (task=classify) or target elements (task=regress)."""
    size = num_classes if num_classes is not None else num_outputs
    if size is None:
        raise TypeError("the model needs num_classes (task=classify) or num_outputs (task=regress)")
    return size


def masked_mean(h: Tensor, mask: Tensor) -> Tensor:
    """Mean over real rows: h [B, L, D], mask [B, L] -> [B, D]; a sample with 0 rows gives zeros."""
    weights = mask.to(h.dtype).unsqueeze(-1)  # [B, L, 1], 0/1: exact in any dtype
    # Summed in float32 whatever h's dtype: bf16 holds integers exactly only up to 256 (257 rows
    # counted as 256), so fsdp's bf16 parameters would average differently from ddp's float32.
    total = (h * weights).sum(dim=1, dtype=torch.float32)  # [B, D]
    count = mask.sum(dim=1, dtype=torch.float32).clamp_min(1.0).unsqueeze(-1)  # [B, 1]
    return (total / count).to(h.dtype)


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

    def __init__(self, in_features: int, num_classes: int | None = None, hidden_dim: int = 64,
                 num_layers: int = 2, num_outputs: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(in_features, hidden_dim), nn.GELU())
        self.blocks = nn.ModuleList(_ResidualMlpBlock(hidden_dim) for _ in range(num_layers))
        self.head = nn.Linear(hidden_dim, head_size(num_classes, num_outputs))

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

    def __init__(self, in_features: int, num_classes: int | None = None, d_model: int = 64,
                 num_heads: int = 4, num_layers: int = 2, ff_dim: int = 128, dropout: float = 0.0,
                 num_outputs: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Linear(in_features, d_model)
        self.blocks = nn.ModuleList(_EncoderBlock(d_model, num_heads, ff_dim, dropout)
                                    for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, head_size(num_classes, num_outputs))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        if x.shape[1] == 0:  # a batch of 0-row samples: one masked-out zero row keeps shapes valid
            x = x.new_zeros(x.shape[0], 1, x.shape[2])
            mask = mask.new_zeros(mask.shape[0], 1)
        # A sample with 0 rows would make attention all-masked (NaN): give it one masked-in zero row
        # for attention only; masked_mean still ignores it.
        # No `if empty.any()`: reading it on the host would stall every micro-batch on a GPU.
        empty = ~mask.any(dim=1)  # [B]
        attend = mask.clone()
        attend[:, 0] |= empty
        h = self.run_blocks(self.embed(x), ~attend)  # [B, L, D]
        return self.head(masked_mean(self.norm(h), mask))


class _DecoderBlock(nn.Module):
    """Pre-norm causal self-attention and MLP, each added to the residual stream."""

    def __init__(self, d_model: int, num_heads: int, ff_mult: int, dropout: float) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of num_heads={num_heads}")
        self.num_heads, self.dropout = num_heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, ff_mult * d_model), nn.GELU(),
                                 nn.Linear(ff_mult * d_model, d_model))

    def forward(self, h: Tensor) -> Tensor:
        b, length, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, length, 3, self.num_heads, d // self.num_heads) \
            .permute(2, 0, 3, 1, 4)  # 3 x [B, heads, L, head_dim]
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  dropout_p=self.dropout if self.training else 0.0)
        h = h + self.proj(attended.transpose(1, 2).reshape(b, length, d))
        return h + self.mlp(self.norm2(h))


class GPT(_Checkpointable):
    """A decoder-only transformer: token and position embeddings, causal blocks, a final norm,
    and a head tied to the token embedding (one matrix: half the embedding parameters)."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int = 128, num_heads: int = 4,
                 num_layers: int = 4, ff_mult: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.embed = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(_DecoderBlock(d_model, num_heads, ff_mult, dropout)
                                    for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position.weight, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.embed(tokens) + self.position(positions)  # [B, L, D]
        return self.head(self.norm(self.run_blocks(h)))  # [B, L, V]

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 per parameter (forward 2, backward 4; the position table
        is a lookup, not a matmul) plus causal attention's 6 x layers x d_model x seq_len
        (QK^T and AV, forward and backward, halved by the causal mask): PaLM's appendix B count."""
        params = sum(p.numel() for name, p in self.named_parameters() if not name.startswith("position"))
        d_model = self.embed.embedding_dim
        return 6 * params + 6 * len(self.blocks) * d_model * self.seq_len
