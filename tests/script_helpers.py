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

# Uses switchyard.preemption: checkpoints on SIGUSR2 and asks to be requeued; each rank keeps its
# own step in RUN/checkpoints (no process group needed to show the resume).
PREEMPTIBLE_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    from switchyard import preemption

    preemption.install()
    rank = int(os.environ["RANK"])
    saved = preemption.checkpoint_dir() / f"rank-{rank}.json"
    step = json.loads(saved.read_text())["step"] if saved.exists() else 0
    print(f"rank {rank} starts at step {step}, restart {preemption.restart_count()}", flush=True)
    while step < int(os.environ.get("STEPS", "300")):
        step += 1
        time.sleep(0.05)
        if rank == 0:
            (preemption.run_dir() / "progress").write_text(str(step))
        if preemption.stop_requested():
            saved.write_text(json.dumps({"step": step}))
            print(f"rank {rank} checkpointed at step {step} ({preemption.reason()})", flush=True)
            preemption.requeue()
    (preemption.run_dir() / f"final-{rank}.json").write_text(json.dumps({"step": step}))
    print(f"rank {rank} finished at step {step}", flush=True)
""")

# Ignores SLURM's warning signal entirely: Switchyard must requeue it anyway.
IGNORING_SCRIPT = textwrap.dedent("""
    import os, signal, time
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    restart = int(os.environ["SWITCHYARD_RESTART_COUNT"])
    print(f"rank {os.environ['RANK']} restart {restart}", flush=True)
    if restart == 0:
        open(os.path.join(os.environ["SWITCHYARD_RUN_DIR"], f"started-{os.environ['RANK']}"), "w").close()
        time.sleep(600)
""")
