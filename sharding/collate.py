"""Batching for variable leading sizes: pad-to-longest collate, and length-grouped batches.

``collate_padded`` is the DataLoader ``collate_fn``: the only place a sample's bytes are copied.
``length_grouped_batches`` is a pure function (no I/O, no torch) that orders one partition's
indices into batches of similar lengths, so padding costs less; it keeps the batch count of plain
batching, so ranks with equal partitions still take equal numbers of steps.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sharding.format import DatasetError

if TYPE_CHECKING:
    import torch


def collate_padded(
    samples: Sequence[Mapping[str, Any]], *, fixed: Collection[str] = (), pad_value: float = 0
) -> dict[str, torch.Tensor]:
    """Batch samples of ``{field: tensor or array}``.

    - a scalar field, or a field named in ``fixed`` (pass ``dataset.fixed_fields``), is stacked:
      ``[B, *shape]``;
    - every other field is padded with ``pad_value`` to the longest in the batch:
      ``field`` ``[B, max_len, *trailing]``, ``field_lengths`` int64 ``[B]`` and
      ``field_mask`` bool ``[B, max_len]`` (True on real rows).

    The keys depend only on the schema and ``fixed``, never on the batch, so every batch of an
    epoch has the same keys.
    """
    import torch  # deferred: keep torch off the import path of `sharding` itself

    if not samples:
        raise DatasetError("collate_padded got an empty batch: there is nothing to stack")
    names = list(samples[0])
    for number, sample in enumerate(samples):
        if list(sample) != names:
            raise DatasetError(
                f"collate_padded: batch item {number} has fields {list(sample)}, "
                f"item 0 has {names}; every sample needs the same fields"
            )
    batch: dict[str, torch.Tensor] = {}
    for name in names:
        tensors = [torch.as_tensor(s[name]) for s in samples]
        if tensors[0].dim() == 0 or name in fixed:
            batch[name] = _stack(name, tensors)
        else:
            _add_padded(batch, name, tensors, pad_value)
    return batch


def _stack(name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    import torch

    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) > 1:
        raise DatasetError(
            f"collate_padded: field {name!r} is treated as fixed-shape but the "
            f"batch holds shapes {sorted(shapes)}; leave it out of fixed= to pad it"
        )
    return torch.stack(tensors)


def _add_padded(
    batch: dict[str, torch.Tensor], name: str, tensors: list[torch.Tensor], pad_value: float
) -> None:
    import torch

    for suffix in ("_lengths", "_mask"):
        if name + suffix in batch:
            raise DatasetError(
                f"collate_padded: field {name + suffix!r} collides with the "
                f"{suffix[1:]} of field {name!r}; rename one of them"
            )
    first = tensors[0]
    for t in tensors[1:]:
        if t.dim() != first.dim() or t.shape[1:] != first.shape[1:] or t.dtype != first.dtype:
            raise DatasetError(
                f"collate_padded: field {name!r} mixes {first.dtype}"
                f"{list(first.shape)} and {t.dtype}{list(t.shape)}: only the "
                f"leading dimension may differ"
            )
    lengths = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64)  # [B]
    max_len = int(lengths.max())
    out = torch.full((len(tensors), max_len, *first.shape[1:]), pad_value, dtype=first.dtype)
    for row, t in enumerate(tensors):
        out[row, : t.shape[0]] = t  # the one copy out of the memory map
    batch[name] = out  # [B, max_len, *trailing]
    batch[name + "_lengths"] = lengths
    batch[name + "_mask"] = torch.arange(max_len)[None, :] < lengths[:, None]  # [B, max_len]


def length_grouped_batches(
    indices: np.ndarray,
    lengths: np.ndarray,
    batch_size: int,
    seed: int,
    *,
    batches_per_group: int = 64,
    drop_last: bool = False,
) -> list[np.ndarray]:
    """Split one partition's ``indices`` into batches of similar length, deterministic per seed.

    ``lengths[j]`` is the length of ``indices[j]``. The indices are shuffled, cut into groups of
    ``batches_per_group * batch_size``, sorted by length inside each group and cut into batches;
    then the order of the batches is shuffled. Sorting within groups rather than globally keeps
    randomness in which samples meet, and the final shuffle keeps long batches from all arriving
    at the end. Returns ``ceil(n / batch_size)`` batches (``floor`` with ``drop_last``): exactly
    as many as plain batching. The one short batch, if any, stays last, as in plain batching: so
    after k batches every rank with as many entries has consumed as many, and one sampler state
    fits all ranks.
    """
    idx = np.asarray(indices)
    lens = np.asarray(lengths)
    if idx.ndim != 1 or lens.shape != idx.shape:
        raise ValueError(
            f"indices {idx.shape} and lengths {lens.shape} must be 1-D and equal "
            f"in length: lengths[j] is the length of indices[j]"
        )
    if batch_size < 1 or batches_per_group < 1:
        raise ValueError(
            f"batch_size={batch_size}, batches_per_group={batches_per_group}: both must be >= 1"
        )
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(idx))  # [n] shuffled positions
    group = batch_size * batches_per_group
    ordered = (
        np.concatenate(
            [  # [n] positions, sorted by length within each group
                chunk[np.argsort(lens[chunk], kind="stable")]
                for chunk in np.split(perm, range(group, len(perm), group))
            ]
        )
        if len(perm)
        else perm
    )
    batches = [idx[ordered[s : s + batch_size]] for s in range(0, len(ordered), batch_size)]
    short = batches.pop() if batches and len(batches[-1]) < batch_size else None
    shuffled = [batches[b] for b in rng.permutation(len(batches))]
    return shuffled if short is None or drop_last else [*shuffled, short]


def padding_fraction(batches: Sequence[np.ndarray], lengths: np.ndarray) -> float:
    """Share of padded batch rows that are padding, over all ``batches`` (0.0 = no waste).

    ``lengths[i]`` is the length of sample ``i`` (e.g. ``dataset.leading_sizes(field)``).
    """
    all_lengths = np.asarray(lengths)
    real = padded = 0
    for batch in batches:
        batch_lengths = all_lengths[np.asarray(batch, dtype=np.int64)]  # [len(batch)]
        if batch_lengths.size:
            real += int(batch_lengths.sum())
            padded += int(batch_lengths.max()) * batch_lengths.size
    return 1.0 - real / padded if padded else 0.0
