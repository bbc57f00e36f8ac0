"""Fixed-length token windows packed across documents, for language models.

A token dataset holds one document per sample (``tokens: uint16[None]``, EOS at each end, as
``jobs.prepare format=text`` writes it). Read back to back the documents are one token stream of
``T`` tokens; window ``w`` is the ``seq_len + 1`` tokens starting at ``w * seq_len`` (inputs are
its first ``seq_len``, targets its last ``seq_len``: consecutive windows share one token, so every
token but the first is a target exactly once per epoch). There are ``(T - 1) // seq_len`` windows;
the last ``< seq_len`` tokens are never a target.

Nothing is materialised per window (Megatron builds a sample index of every window on disk): a
window's documents come from one ``searchsorted`` over the documents' start offsets (int64 [D],
from the index files), computed on the fly. The sampler sees the windows as samples grouped by the
shard their first token lies in, so it partitions, pads, resumes and resumes elastically exactly as
it does for samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, Dataset

from sharding.format import DatasetError
from sharding.reader import ShardedDataset
from sharding.sampler import ShardedSampler, decode_array, shard_counts_digest

Batch = dict[str, torch.Tensor]


class TokenWindows(Dataset[Batch]):
    """The windows of one token field, indexed by ShardedSampler values (negative = padding).

    ``windows.__getitems__(values)`` -> ``{"input": int64 [B, seq_len], "target": int64 [B, seq_len],
    "index": int64 [B], "is_pad": bool [B]}``. Pickles without memory maps, like the dataset.
    """

    def __init__(self, dataset: ShardedDataset, field: str, seq_len: int) -> None:
        spec = dataset.schema.get(field)
        if spec is None or spec.shape != (None,) or not spec.dtype.startswith(("uint", "int")):
            fields = ", ".join(f"{n}: {s}" for n, s in dataset.schema.items())
            raise DatasetError(f"{dataset.root}: field {field!r} must be 1-D integer tokens of any "
                               f"length (fields: {fields})")
        if seq_len < 1:
            raise DatasetError(f"seq_len={seq_len} is invalid: must be >= 1")
        self.dataset, self.field, self.seq_len = dataset, field, seq_len
        lengths = dataset.leading_sizes(field)  # int64 [D]
        self.doc_starts = np.zeros(len(lengths) + 1, dtype=np.int64)  # int64 [D + 1]
        np.cumsum(lengths, out=self.doc_starts[1:])
        self.num_tokens = int(self.doc_starts[-1])
        self.num_windows = max(self.num_tokens - 1, 0) // seq_len

    @property
    def shard_counts(self) -> tuple[int, ...]:
        """Windows per shard (by the shard of each window's first token): the sampler's counts."""
        shard_docs = np.cumsum(self.dataset.shard_counts)  # int64 [S]: docs before each shard's end
        shard_token_ends = self.doc_starts[shard_docs]  # int64 [S]
        # windows starting before each shard's end: ceil(end / seq_len), capped at the total
        starts_before = np.minimum(-(-shard_token_ends // self.seq_len), self.num_windows)
        return tuple(np.diff(starts_before, prepend=0).tolist())

    def __len__(self) -> int:
        return self.num_windows

    def __getitems__(self, values: Sequence[int]) -> Batch:
        windows, is_pad = decode_array(values)  # int64 [B], bool [B]
        out = np.empty((len(windows), self.seq_len + 1), dtype=np.int64)  # int64 [B, seq_len + 1]
        for row, window in enumerate(windows.tolist()):
            self._read(window, out[row])
        tokens = torch.from_numpy(out)
        return {"input": tokens[:, :-1], "target": tokens[:, 1:],
                "index": torch.from_numpy(windows), "is_pad": torch.from_numpy(is_pad)}

    def _read(self, window: int, out: np.ndarray) -> None:
        """Copy window ``window``'s tokens into ``out`` (int64 [seq_len + 1]), across documents."""
        if not 0 <= window < self.num_windows:
            raise IndexError(f"window {window} is out of range for {self.num_windows} windows")
        start = window * self.seq_len
        doc = int(np.searchsorted(self.doc_starts, start, side="right")) - 1
        filled, offset = 0, start - int(self.doc_starts[doc])
        while filled < len(out):  # a short document: the window goes on in the next one
            tokens = self.dataset.sample(doc)[self.field]
            take = min(len(tokens) - offset, len(out) - filled)
            out[filled:filled + take] = tokens[offset:offset + take]
            filled, offset, doc = filled + take, 0, doc + 1

    def largest_id(self) -> int:
        """The largest token id, read from every shard: what an embedding of fewer rows would fail
        on, on every rank. Each shard is read in blocks of documents, one vectorized gather and
        max per block (a dataset of one field is its data file back to back, padding zeros: one
        max per shard)."""
        dataset, largest, first = self.dataset, 0, 0
        dtype = np.dtype(dataset.schema[self.field].dtype)
        for count in dataset.shard_counts:
            if count:
                sources, spots = dataset.spans(np.arange(first, first + count), [self.field])
                data = sources[0]  # uint8 [data bytes] of this shard
                tokens = data[:len(data) // dtype.itemsize * dtype.itemsize].view(dtype)  # [elements]
                if list(dataset.schema) == [self.field]:
                    largest = max(largest, int(tokens.max(initial=0)))
                else:
                    starts, lengths = spots[self.field]  # int64 [count] each: bytes, tokens
                    largest = max(largest, _largest_in(tokens, starts // dtype.itemsize, lengths))
            first += count
        return largest

    def example(self) -> Batch:
        """One real window (the first), for a model's start-up and pre-submission checks."""
        return self.__getitems__([0])


def _largest_in(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                block_tokens: int = 1 << 23) -> int:
    """The largest of ``tokens[starts[k] : starts[k] + lengths[k]]`` over all k, gathered in blocks
    of about ``block_tokens`` (int64 temporaries of 64 MiB at most, but for one longer document)."""
    largest, k = 0, 0
    ends = np.cumsum(lengths)  # int64 [D]: tokens up to each document's end
    while k < len(starts):
        stop = max(int(np.searchsorted(ends, ends[k] - lengths[k] + block_tokens, side="right")), k + 1)
        block_lengths = lengths[k:stop]  # int64 [B]
        before = np.cumsum(block_lengths) - block_lengths  # int64 [B]: block tokens before each
        at = np.repeat(starts[k:stop] - before, block_lengths) + np.arange(int(block_lengths.sum()))
        largest = max(largest, int(tokens[at].max(initial=0)))
        k = stop
    return largest


def window_loader(windows: TokenWindows, sampler: ShardedSampler, batch_size: int, *,
                  num_workers: int = 0, pin_memory: bool = False,
                  worker_ignores: tuple[Any, ...] = ()) -> Any:
    """A DataLoader of window batches in the sampler's order (``len`` equal on every rank)."""
    from sharding.loader import ShardedLoader, pass_batch  # the loader pulls in batch memory

    counts = np.asarray(windows.shard_counts, dtype=np.int64)
    if sampler.state_dict()["shard_counts_digest"] != shard_counts_digest(counts):
        raise DatasetError("the sampler was built for other window counts: build it with "
                           "ShardedSampler(windows.shard_counts, ...)")
    return ShardedLoader(windows, ring_slots=0, worker_ignores=worker_ignores,  # type: ignore[arg-type]
                         batch_sampler=BatchSampler(sampler, batch_size, drop_last=False),
                         collate_fn=pass_batch, num_workers=num_workers, pin_memory=pin_memory,
                         persistent_workers=num_workers > 0)
