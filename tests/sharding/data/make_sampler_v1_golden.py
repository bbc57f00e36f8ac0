"""Writes sampler_v1_golden.json: states saved by ShardedSampler version 1 (commit dc39507, before
the counter-based shuffles) and what that version's ranks yielded after loading them. Run it in a
checkout of that commit:

    git worktree add /tmp/v1 dc39507 && cd /tmp/v1 && \
        PYTHONPATH=. python /path/to/make_sampler_v1_golden.py > sampler_v1_golden.json
"""

import json
import sys

from sharding.partition import Partition
from sharding.sampler import ShardedSampler

COUNTS = [7, 0, 13, 5, 9, 11, 1, 4]

def reversed_order(part, epoch, segment, world_size, rank):
    return Partition(part.indices[::-1].copy(), part.is_pad[::-1].copy())

def make(world, rank, policy, order):
    s = ShardedSampler(COUNTS, world_size=world, rank=rank, seed=3, policy=policy)
    if order:
        s.set_visit_order(reversed_order, "reversed")
    return s

def saved(stretches, policy, order):
    state = None
    for world, consumed in stretches:
        s = make(world, 0, policy, order)
        if state is None:
            s.set_epoch(2)
        else:
            s.load_state_dict(state)
        s.advance(consumed)
        state = s.state_dict()
    return state

def resumed(state, world, policy, order):
    out = []
    for rank in range(world):
        s = make(world, rank, policy, order)
        s.load_state_dict(state)
        out.append(list(s))
    return out

cases = []
for name, stretches, policy, order, worlds in [
    ("pad, 3 ranks", [(3, 5)], "pad", False, [3, 2]),
    ("drop, 4 ranks", [(4, 3)], "drop", False, [3, 4]),
    ("pad, 3 then 2 ranks", [(3, 2), (2, 4)], "pad", False, [4, 2]),
    ("pad, visited reversed", [(2, 6)], "pad", True, [3, 2]),
]:
    state = saved(stretches, policy, order)
    cases.append({"name": name, "policy": policy, "reversed": order, "state": state,
                  "resumed": {str(w): resumed(state, w, policy, order) for w in worlds}})
json.dump(cases, sys.stdout)
