"""What the tests of `switchyard run` and `switchyard.submit` share: scripts written as users write them."""

from __future__ import annotations

import textwrap

# Written against torch.distributed and torchrun's variables only: nothing of Switchyard.
DDP_SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    local = f"{os.environ['LOCAL_RANK']}/{os.environ['LOCAL_WORLD_SIZE']}"
    print(f"rank {rank}/{world} local {local} on {os.uname().nodename} "
          f"run {os.environ['SWITCHYARD_RUN_DIR']}: sum={total.item():g}", flush=True)
    if os.environ.get("FAIL_RANK") == str(rank):
        print(f"rank {rank} gives up here", flush=True)
        print("the last words of the failing rank", file=sys.stderr, flush=True)
        sys.exit(3)
    dist.barrier()
    dist.destroy_process_group()
""")
