"""ShardedSampler: encoding, exact and elastic resume, and a real torch DataLoader."""

import io
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, get_worker_info

from sharding.partition import PartitionError, Policy, partition
from sharding.sampler import (
    SamplerStateError,
    ShardedSampler,
    decode,
    decode_array,
)

SHARD_COUNTS = st.one_of(
    st.lists(st.integers(0, 40), min_size=1, max_size=20),
    st.lists(st.integers(0, 12), min_size=50, max_size=200),
    st.lists(st.integers(0, 2000), min_size=1, max_size=3),
).filter(lambda counts: sum(counts) > 0)
POLICIES_ST: st.SearchStrategy[Policy] = st.sampled_from(["pad", "drop"])


def samplers(
    counts: Sequence[int],
    world_size: int,
    *,
    seed: int = 0,
    policy: Policy = "pad",
    shuffle: bool = True,
) -> list[ShardedSampler]:
    return [
        ShardedSampler(
            counts, world_size=world_size, rank=rank, seed=seed, policy=policy, shuffle=shuffle
        )
        for rank in range(world_size)
    ]


def take(sampler: ShardedSampler, count: int) -> list[int]:
    """Iterate `count` entries and record them consumed, as a trainer would."""
    values: list[int] = []
    for value in sampler:
        if len(values) == count:
            break
        values.append(value)
    sampler.advance(len(values))
    return values


def real_of(values: Sequence[int]) -> list[int]:
    return [index for index, is_pad in map(decode, values) if not is_pad]


def test_decode_undoes_the_padding_encoding() -> None:
    assert decode(7) == (7, False)
    assert decode(~7) == (7, True)
    assert decode(-1) == (0, True)
    indices, is_pad = decode_array([0, 5, ~5, ~0])
    assert indices.tolist() == [0, 5, 5, 0]
    assert is_pad.tolist() == [False, False, True, True]


@settings(max_examples=40, deadline=None)
@given(SHARD_COUNTS, st.integers(1, 256), st.data(), POLICIES_ST)
def test_sampler_yields_its_partition_with_padding_encoded(
    counts: list[int], world_size: int, data: st.DataObject, policy: Policy
) -> None:
    assume(policy == "pad" or sum(counts) >= world_size)
    rank = data.draw(st.integers(0, world_size - 1))
    sampler = ShardedSampler(counts, world_size=world_size, rank=rank, seed=3, policy=policy)
    sampler.set_epoch(2)
    expected = partition(counts, world_size=world_size, rank=rank, epoch=2, seed=3, policy=policy)
    values = list(sampler)
    assert len(values) == len(sampler) == len(expected)
    assert all(isinstance(v, int) for v in values)
    indices, is_pad = decode_array(values)
    assert np.array_equal(indices, expected.indices)
    assert np.array_equal(is_pad, expected.is_pad)
    assert np.array_equal(sampler.partition.indices, expected.indices)


@settings(max_examples=40, deadline=None)
@given(SHARD_COUNTS, st.integers(1, 256), st.data(), POLICIES_ST)
def test_same_world_resume_continues_exactly_where_it_stopped(
    counts: list[int], world_size: int, data: st.DataObject, policy: Policy
) -> None:
    assume(policy == "pad" or sum(counts) >= world_size)
    rank = data.draw(st.integers(0, world_size - 1))
    kwargs: dict[str, Any] = {"world_size": world_size, "rank": rank, "seed": 11}
    uninterrupted = ShardedSampler(counts, policy=policy, **kwargs)
    uninterrupted.set_epoch(5)
    full = list(uninterrupted)
    stopped = data.draw(st.integers(0, len(full)), label="entries consumed")
    first = ShardedSampler(counts, policy=policy, **kwargs)
    first.set_epoch(5)
    assert take(first, stopped) == full[:stopped]
    resumed = ShardedSampler(counts, policy=policy, **kwargs)
    resumed.load_state_dict(first.state_dict())
    resumed.set_epoch(5)  # what a trainer's epoch loop does after loading: keeps the progress
    assert len(resumed) == len(full) - stopped
    assert list(resumed) == full[stopped:]


@settings(max_examples=40, deadline=None)
@given(SHARD_COUNTS, st.integers(1, 64), st.integers(1, 64), st.data(), POLICIES_ST)
def test_resume_on_another_world_size_covers_each_remaining_sample_once(
    counts: list[int], old_world: int, new_world: int, data: st.DataObject, policy: Policy
) -> None:
    num_samples = sum(counts)
    # A drop sampler with fewer samples than ranks is refused when built (tested elsewhere).
    assume(policy == "pad" or num_samples >= max(old_world, new_world))
    old = samplers(counts, old_world, seed=1, policy=policy)
    consumed = data.draw(st.integers(0, len(old[0])), label="entries consumed")
    seen = [index for s in old for index in real_of(take(s, consumed))]
    states = [s.state_dict() for s in old]
    assert all(state == states[0] for state in states)  # save once, from any rank
    new = samplers(counts, new_world, seed=1, policy=policy)
    for sampler in new:
        sampler.load_state_dict(states[0])
    assert len({len(s) for s in new}) == 1
    resumed = [index for s in new for index in real_of(list(s))]
    everything = seen + resumed
    assert len(set(everything)) == len(everything)
    if policy == "pad":
        assert sorted(everything) == list(range(num_samples))
    else:
        left = num_samples - len(seen)
        assert left - len(resumed) <= new_world - 1


def test_chained_resumes_over_worlds_4_3_5_cover_the_epoch_once() -> None:
    counts = [13, 0, 29, 7, 1, 40, 0, 22]  # 112 samples
    seen: list[int] = []
    state: dict[str, Any] | None = None
    for world_size, steps in [(4, 5), (3, 4), (5, None)]:
        group = samplers(counts, world_size, seed=4)
        for sampler in group:
            sampler.set_epoch(7)
            if state is not None:
                sampler.load_state_dict(state)
        count = len(group[0]) if steps is None else steps
        assert len({len(s) for s in group}) == 1
        seen += [index for s in group for index in real_of(take(s, count))]
        state = group[0].state_dict()
    assert state is not None
    assert [tuple(s) for s in state["segments"]] == [(4, 5), (3, 4), (5, len(group[0]))]
    assert sorted(seen) == list(range(112))


def test_resume_back_on_the_first_world_after_an_idle_detour_is_exact() -> None:
    counts = [50, 50]
    first = ShardedSampler(counts, world_size=4, rank=1, seed=2)
    full = list(first)
    take(first, 6)
    detour = ShardedSampler(counts, world_size=3, rank=0, seed=2)
    detour.load_state_dict(first.state_dict())  # preempted again before any step
    back = ShardedSampler(counts, world_size=4, rank=1, seed=2)
    back.load_state_dict(detour.state_dict())
    assert list(back) == full[6:]


def test_set_epoch_restarts_and_changes_the_order() -> None:
    sampler = ShardedSampler([30, 30, 30], world_size=2, rank=0, seed=0)
    epoch0 = list(sampler)
    take(sampler, 10)
    sampler.set_epoch(1)
    assert sampler.state_dict()["segments"] == [[2, 0]]
    assert len(sampler) == 45
    assert list(sampler) != epoch0


def test_state_dict_survives_json_and_torch_save() -> None:
    sampler = ShardedSampler([10, 20], world_size=3, rank=2, seed=8, policy="drop")
    take(sampler, 4)
    state = sampler.state_dict()
    assert json.loads(json.dumps(state)) == state
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state


def test_advance_past_the_epoch_is_refused() -> None:
    sampler = ShardedSampler([5], world_size=2, rank=0)
    sampler.advance(3)
    with pytest.raises(ValueError, match="set_epoch"):
        sampler.advance(1)
    with pytest.raises(ValueError, match="num_entries=-1"):
        sampler.advance(-1)
    with pytest.raises(TypeError, match="len\\(batch\\)"):
        sampler.advance(2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("version", 3, "version=3"),
        ("seed", 99, "seed=99"),
        ("policy", "drop", "policy='drop'"),
        ("shuffle", False, "shuffle=False"),
        ("shard_counts_digest", "0" * 32, "shard_counts_digest"),
        ("segments", [[2, 1000]], "consumed_per_rank=1000"),
        ("segments", [[2]], "world_size, consumed_per_rank"),
    ],
)
def test_a_state_from_elsewhere_is_refused_and_changes_nothing(
    field: str, value: object, message: str
) -> None:
    sampler = ShardedSampler([10, 10], world_size=2, rank=0, seed=1)
    state = sampler.state_dict()
    state[field] = value
    before = list(sampler)
    with pytest.raises(SamplerStateError, match=message):
        sampler.load_state_dict(state)
    assert list(sampler) == before
    assert sampler.state_dict()["segments"] == [[2, 0]]


def test_a_missing_field_is_named() -> None:
    sampler = ShardedSampler([4], world_size=1, rank=0)
    state = sampler.state_dict()
    del state["segments"]
    with pytest.raises(SamplerStateError, match="segments"):
        sampler.load_state_dict(state)


def test_constructor_errors_come_early_and_name_the_value() -> None:
    with pytest.raises(PartitionError, match="rank=2"):
        ShardedSampler([4], world_size=2, rank=2)
    with pytest.raises(PartitionError, match="use policy='pad'"):
        ShardedSampler([1, 1], world_size=3, rank=0, policy="drop")
    with pytest.raises(PartitionError, match="dataset is empty"):
        ShardedSampler([0, 0], world_size=1, rank=0)


def test_unshuffled_sampler_yields_the_block_in_natural_order() -> None:
    group = samplers([3, 0, 4], 3, shuffle=False)  # 7 samples: blocks 2, 2, 3
    assert [list(s) for s in group] == [[0, 1, ~1], [2, 3, ~3], [4, 5, 6]]


class WhoFetched(Dataset[tuple[int, int, bool]]):
    """Map-style dataset returning (sample index, worker id, is_pad) for each sampler value."""

    def __len__(self) -> int:
        return 1_000_000  # only indexed through the sampler

    def __getitem__(self, value: int) -> tuple[int, int, bool]:
        index, is_pad = decode(value)
        info = get_worker_info()
        return index, -1 if info is None else info.id, is_pad


def fetch_all(sampler: ShardedSampler, num_workers: int) -> tuple[np.ndarray, ...]:
    loader = DataLoader(WhoFetched(), sampler=sampler, batch_size=4, num_workers=num_workers)
    indices, workers, pads = [], [], []
    for index, worker, is_pad in loader:
        indices.append(index)
        workers.append(worker)
        pads.append(is_pad)
        sampler.advance(len(index))
    return tuple(torch.cat(x).numpy() for x in (indices, workers, pads))


def test_dataloader_workers_fetch_every_entry_exactly_once() -> None:
    counts = [17, 0, 30, 5]  # 52 samples over 3 ranks: 18 entries each, two ranks pad once
    for rank in range(3):
        sampler = ShardedSampler(counts, world_size=3, rank=rank, seed=6)
        expected = sampler.partition
        indices, workers, pads = fetch_all(sampler, num_workers=2)
        assert np.array_equal(indices, expected.indices)  # in order, none twice, none missed
        assert np.array_equal(pads, expected.is_pad)
        assert set(workers.tolist()) == {0, 1}  # both workers took part
        assert sampler.state_dict()["segments"] == [[3, 18]]


@pytest.mark.parametrize("policy", ["pad", "drop"])
def test_two_ranks_through_dataloaders_are_disjoint(policy: Policy) -> None:
    counts = [9, 12, 0, 20]  # 41 samples
    fetched = []
    for rank in range(2):
        sampler = ShardedSampler(counts, world_size=2, rank=rank, seed=1, policy=policy)
        indices, _, pads = fetch_all(sampler, num_workers=0)
        fetched.append(set(indices[~pads].tolist()))
    assert not fetched[0] & fetched[1]
    union = fetched[0] | fetched[1]
    if policy == "pad":
        assert union == set(range(41))
    else:
        assert 41 - len(union) <= 1


def test_resume_through_a_dataloader_mid_epoch_on_another_world() -> None:
    counts = [25, 25, 25, 25]
    old = samplers(counts, 4, seed=9)
    seen: list[int] = []
    for sampler in old:
        loader = DataLoader(WhoFetched(), sampler=sampler, batch_size=5)
        for step, (index, _, is_pad) in enumerate(loader):
            if step == 2:  # preempted after two optimizer steps
                break
            seen += index[~is_pad].tolist()
            sampler.advance(len(index))
    new = samplers(counts, 3, seed=9)
    for sampler in new:
        sampler.load_state_dict(old[0].state_dict())
        indices, _, pads = fetch_all(sampler, num_workers=0)
        seen += indices[~pads].tolist()
    assert sorted(seen) == list(range(100))


# -- states saved by version 1 ---------------------------------------------------------------------

# What a development build before the first release saved after 5 entries per rank at 3 ranks
# (epoch 2, seed 3, shard counts [7, 0, 13, 5, 9, 11, 1, 4]). Its order was another one (a numpy
# Generator per shard and per block), so its progress names other samples than version 2's.
V1_STATE = {"version": 1, "epoch": 2, "seed": 3, "policy": "pad", "shuffle": True, "num_samples": 50,
            "shard_counts_digest": "d306225e668ac687cd537d144e9def43", "segments": [[3, 5]],
            "visit_order": "partition"}


@pytest.mark.parametrize("world", [3, 2])
def test_a_version_1_state_is_refused_naming_both_versions_and_the_fix(world: int) -> None:
    """Version 1 was never released: its reader (sharding/partition_v1.py) is gone, and its states
    are refused before anything changes, rather than resumed in version 2's order."""
    sampler = ShardedSampler([7, 0, 13, 5, 9, 11, 1, 4], world_size=world, rank=0, seed=3)
    before = list(sampler)
    message = r"version=1 is the sampler order of a development build .* reads version 2, .*set_epoch"
    with pytest.raises(SamplerStateError, match=message):
        sampler.load_state_dict(V1_STATE)
    assert list(sampler) == before and sampler.state_dict()["segments"] == [[world, 0]]
    sampler.load_state_dict({**V1_STATE, "version": 2})  # the same progress, as version 2's, is read
    assert len(sampler) == (17 - 5 if world == 3 else (50 - 3 * 5 + 1) // 2)  # 50 samples, pad
