"""Search benchmark: the same hyperparameter search run in batches without pruning, as Hydra's
Optuna sweeper runs it (ask ``n_jobs`` trials, launch them, wait for the whole batch, tell,
repeat), then asynchronously (``hydra/sweeper=switchyard_optuna``) without pruning, then
asynchronously with ASHA: what asynchrony alone saves, and what pruning adds.

Both runs ask the same trials: a seeded random sampler's sequence does not depend on what it was
told. Each trial trains ``tests/search_helpers.py``'s quadratic (known optimum lr = 0.25) as an
ordinary ``jobs.train`` job; a trial's cost varies as real trials' do (a model's width, a batch
size), here by a second searched parameter, the seconds each step sleeps (``+model.delay_s``).

What it measures (docs/performance.md, "Hyperparameter search", holds the figures):

- wall time from the first submission to the search's end;
- trial-steps: the steps all trials ran, summed (a pruned trial's stop at its last eval window);
- the best value found, which both runs must reach alike for the comparison to be fair.

How to run (cluster=local: one CPU rank per trial; cluster=slurm: on the local cluster)::

    .venv/bin/python bench/search_bench.py [--cluster slurm] [--trials 12] [--jobs 3]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])

from orchestrator.registry.db import Registry  # noqa: E402
from orchestrator.search import controller, metrics  # noqa: E402
from orchestrator.search.settings import SearchSettings  # noqa: E402

BASE = ["model=custom", "model._target_=search_helpers.Scalar", "task=custom",
        "task._target_=search_helpers.Quadratic", "optim=sgd", "optim.momentum=0", "optim.max_steps=40",
        "eval_every_steps=4", "parallelism.procs_per_node=1", "memory.estimate=off",
        "telemetry.enabled=false", "logger.tensorboard=false"]
PARAMS = {"optim.lr": "tag(log, interval(1e-4, 0.4))", "+model.delay_s": "interval(0.01, 0.1)"}


NAMES = {"batched": "batches of {jobs}, no pruning (Hydra's way)", "async": "asynchronous, no pruning",
         "async_asha": "asynchronous, ASHA"}


class Batched(controller.Controller):
    """Hydra's way: the next batch is asked only once every trial of the last one has ended."""

    def room(self, live: int) -> int:
        return self.settings.n_jobs if live == 0 else 0


def run(kind: str, work: Path, cluster: str, trials: int, jobs: int) -> dict[str, float]:
    settings = SearchSettings(n_trials=trials, n_jobs=jobs, sampler="random", seed=0, poll_s=0.5,
                              pruner="asha" if kind == "async_asha" else "none", params=PARAMS)
    base = [*BASE, f"cluster={cluster}", f"data.cache_dir={work / 'data'}"]
    plan = controller.check(settings, base, "jobs.train")
    sweep_dir = work / kind
    registry = Registry(work / f"{kind}.db")
    sweep_id = registry.create_sweep("train", kind, str(sweep_dir), plan.shape.executor, "")
    registry.record_search(sweep_id, str(sweep_dir / "study.journal"),
                           {"settings": settings.as_dict(), "base": base, "app": "jobs.train"})
    sweep_dir.mkdir(parents=True)
    kind_of = Batched if kind == "batched" else controller.Controller
    started = time.monotonic()
    kind_of(registry, sweep_id, sweep_dir, plan, io.StringIO()).run()
    wall_s = time.monotonic() - started
    rows = registry.trials(sweep_id)
    # every line has its time "t": the last line's step is how far the trial ran
    steps = sum(max((w.step for w in metrics.windows(sweep_dir / str(t.num), "t")), default=0) for t in rows)
    done = [t.value for t in rows if t.state == "COMPLETED" and t.value is not None]
    return {"wall_s": wall_s, "trial_steps": steps, "pruned": sum(t.state == "PRUNED" for t in rows),
            "best": min(done) if done else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", default="local", choices=["local", "slurm"])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--jobs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="search-bench-") as tmp:
        results = {kind: run(kind, Path(tmp), args.cluster, args.trials, args.jobs)
                   for kind in NAMES}
    print(json.dumps(results, indent=1))
    base = results["batched"]
    print("| run | wall s | x batches | trial-steps | x batches | pruned | best eval_loss |\n"
          "|---|---|---|---|---|---|---|")
    for kind, name in NAMES.items():
        r = results[kind]
        print(f"| {name.format(jobs=args.jobs)} | {r['wall_s']:.0f} | {r['wall_s'] / base['wall_s']:.2f} | "
              f"{r['trial_steps']:.0f} | {r['trial_steps'] / base['trial_steps']:.2f} | {r['pruned']:.0f} | "
              f"{r['best']:.3g} |")


if __name__ == "__main__":
    main()
