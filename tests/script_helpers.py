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
        os._exit(3)  # sys.exit with the gloo group alive: torch's teardown may abort (SIGABRT) instead
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

# A user's program submitting a function with switchyard.submit: the function is defined in
# __main__, as in a notebook or a script, so it travels by value.
FUNCTION_PROGRAM = textwrap.dedent("""
    import json, sys
    import switchyard

    def train(scale):
        import os
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        total = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(total)
        out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": total.item() * scale,
               "local_rank": int(os.environ["LOCAL_RANK"]), "run_dir": os.environ["SWITCHYARD_RUN_DIR"]}
        dist.destroy_process_group()
        return out

    if __name__ == "__main__":
        job = switchyard.submit(train, 2.0, overrides=sys.argv[2:], run_dir=sys.argv[1])
        print("ref", job.ref, "job_id", job.job_id, flush=True)
        print("results", json.dumps(job.result()), flush=True)
        print("status", job.status, flush=True)
""")

# Cancels its job after its result came back: a job that has ended stays as it ended.
CANCEL_AFTER_RESULT_PROGRAM = textwrap.dedent("""
    import sys
    import switchyard

    def square(x):
        return x * x

    if __name__ == "__main__":
        job = switchyard.submit(square, 3, overrides=sys.argv[2:], run_dir=sys.argv[1])
        print("ref", job.ref, "job_id", job.job_id, flush=True)
        print("results", job.result(), flush=True)
        job.cancel()
        print("status", job.status, flush=True)
""")

# A callable with submitit's checkpoint() protocol: its state travels in the object it returns.
CHECKPOINTABLE_PROGRAM = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    import submitit
    import switchyard

    class Counter:
        def __init__(self, start=0):
            self.start, self.step = start, start

        def __call__(self, steps):
            run = Path(os.environ["SWITCHYARD_RUN_DIR"])
            while self.step < steps:
                self.step += 1
                time.sleep(0.05)
                if os.environ["RANK"] == "0":
                    (run / "progress").write_text(str(self.step))
            return {"rank": int(os.environ["RANK"]), "started_at": self.start,
                    "restart": int(os.environ["SWITCHYARD_RESTART_COUNT"])}

        def checkpoint(self, steps):
            print(f"checkpoint at step {self.step}", flush=True)
            return submitit.helpers.DelayedSubmission(Counter(self.step), steps)

    if __name__ == "__main__":
        job = switchyard.submit(Counter(), 300, overrides=sys.argv[2:], run_dir=sys.argv[1])
        print("job_id", job.job_id, flush=True)
        print("results", json.dumps(job.result()), flush=True)
""")

# One sweep point per --lr; the point with lr 0.3 fails until RUN/../fixed exists (for resubmit).
SWEEP_SCRIPT = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    lr = float(sys.argv[sys.argv.index("--lr") + 1])
    print(f"rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']} lr={lr}", flush=True)
    if lr == 0.3 and not (Path(os.environ["SWITCHYARD_RUN_DIR"]).parent / "fixed").exists():
        print("lr 0.3 diverges", flush=True)
        sys.exit(3)
""")

# Rank 0 exits 0 at once; rank 1 fails with exit 3 a moment after: the job failed all the same.
LATE_FAILURE_SCRIPT = textwrap.dedent("""
    import os, sys, time
    if os.environ["RANK"] == "1":
        time.sleep(2)
        print("rank 1 fails after rank 0 has finished", flush=True)
        sys.exit(3)
""")
