"""The built-in models' arithmetic, where a dtype could change what they compute."""

from __future__ import annotations

import torch

from jobs.models import masked_mean


def test_masked_mean_counts_rows_in_float32_under_bf16() -> None:
    """fsdp with bf16 parameters: h arrives in bf16. 257 real rows counted in bf16 are 256, so the
    mean came out 256/256 = 1.0 where float32 (ddp) gives 256/257."""
    h = torch.ones(1, 300, 4, dtype=torch.bfloat16)
    h[0, 256] = 0.0  # 256 ones and a zero among the 257 real rows: the sum is exact even in bf16
    mask = torch.zeros(1, 300, dtype=torch.bool)
    mask[0, :257] = True
    expected = masked_mean(h.float(), mask)  # what a float32 model computes
    assert torch.allclose(expected, torch.full((1, 4), 256 / 257))
    got = masked_mean(h, mask)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected.to(torch.bfloat16))  # float32's mean, to bf16 precision


def test_masked_mean_of_random_rows_matches_float32_and_an_empty_sample_is_zero() -> None:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(3, 700, 8, generator=gen)
    mask = torch.zeros(3, 700, dtype=torch.bool)
    mask[0, :257], mask[1, :613] = True, True  # sample 2 has no real rows
    exact = (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp_min(1)
    assert torch.equal(masked_mean(h.to(torch.bfloat16), mask), masked_mean(h.to(torch.bfloat16).float(),
                                                                            mask).to(torch.bfloat16))
    torch.testing.assert_close(masked_mean(h, mask), exact)
    assert torch.equal(masked_mean(h, mask)[2], torch.zeros(8))
