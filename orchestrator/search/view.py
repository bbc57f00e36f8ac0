"""What a search shows: ``switchyard status ID`` (the sweep's jobs, then its trials with their
parameters, value, state and the best so far), ``switchyard best ID`` (the best trial's overrides,
ready to paste, and its run directory) and ``switchyard search resume ID``."""

from __future__ import annotations

import json
import sys
import time
from typing import IO, Any

from orchestrator.registry.db import Attempt, Registry, Trial
from orchestrator.search import space
from orchestrator.search.controller import COMPLETED, PRUNED, SearchError, resume
from orchestrator.search.settings import SearchSettings
from orchestrator.sweeps import status


def is_search(registry: Registry, target: str | None) -> bool:
    """Whether ``target`` names a whole search (``switchyard status ID`` then shows its trials)."""
    if target is None:
        return False
    try:
        ref = status.parse_ref(registry, target)  # the one reader of ids: too large, other digits
    except status.CommandError:
        return False  # not a sweep: status itself says so, in its one error line
    return ref.num is None and registry.search(ref.sweep_id) is not None


def settings_of(registry: Registry, sweep_id: int) -> tuple[SearchSettings, dict[str, Any]]:
    found = registry.search(sweep_id)
    if found is None:
        raise SearchError(f"sweep {sweep_id} is not a search (`switchyard status` lists the sweeps)")
    return SearchSettings.from_dict(found[1]["settings"]), found[1]


def best(registry: Registry, sweep_id: int) -> Trial | None:
    settings, _ = settings_of(registry, sweep_id)
    done = [t for t in registry.trials(sweep_id) if t.state == COMPLETED and t.value is not None]
    if not done:
        return None
    pick = min if settings.direction == "minimize" else max
    return pick(done, key=lambda t: float(t.value or 0.0))


def trial_json(trial: Trial, attempt: Attempt | None) -> dict[str, Any]:
    return {"trial": trial.num, "state": trial.state, "params": trial.params, "value": trial.value,
            "step": trial.step, "error": trial.error,
            "submitted_at": attempt.submitted_at if attempt else None,
            "started_at": attempt.started_at if attempt else None,
            "ended_at": attempt.ended_at if attempt else None}


def state_text(trial: Trial) -> str:
    if trial.state == PRUNED and trial.step is not None:
        return f"PRUNED at step {trial.step}"
    return trial.state


def cmd_status(registry: Registry, sweep_id: int, as_json: bool, out: IO[str] = sys.stdout) -> int:
    """The sweep's own status (jobs), then the trials; ``--json`` adds ``trials`` and ``best``."""
    settings, _ = settings_of(registry, sweep_id)
    if as_json:
        from io import StringIO

        buffer = StringIO()
        status.cmd_status(registry, str(sweep_id), True, buffer)
        shown = json.loads(buffer.getvalue())
        attempts = registry.latest_attempts(sweep_id)
        top = best(registry, sweep_id)
        shown["search"] = {"settings": settings.as_dict(), "best": top.num if top else None,
                           "trials": [trial_json(t, attempts.get(t.num)) for t in registry.trials(sweep_id)]}
        print(json.dumps(shown, indent=1), file=out)
        return 0
    status.cmd_status(registry, str(sweep_id), False, out)
    print(f"\nsearch: {settings.n_trials} trials, {settings.n_jobs} at once, {settings.direction} "
          f"{settings.objective}, sampler {settings.sampler}, pruner {settings.pruner}", file=out)
    print(trials_table(registry, sweep_id, settings), file=out)
    return 0


def trials_table(registry: Registry, sweep_id: int, settings: SearchSettings) -> str:
    trials, top = registry.trials(sweep_id), best(registry, sweep_id)
    keys = list(settings.params)
    rows = [[str(t.num), state_text(t), "-" if t.value is None else f"{t.value:.6g}",
             *[_short(t.params.get(k)) for k in keys], (t.error or "")[:80]] for t in trials]
    table = status.render_table(["TRIAL", "STATE", settings.objective.upper(), *keys, "CAUSE"], rows)
    done = sum(t.state != "RUNNING" for t in trials)
    tail = (f"best so far: trial {top.num}, {settings.objective}={top.value:.6g} "
            f"({' '.join(space.overrides(top.params, {}))})" if top else "best so far: none yet")
    return f"{table}\n{done} of {settings.n_trials} trials ended; {tail}"


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def cmd_best(registry: Registry, sweep_id: int, as_json: bool, out: IO[str] = sys.stdout) -> int:
    settings, recorded = settings_of(registry, sweep_id)
    top = best(registry, sweep_id)
    if top is None:
        raise SearchError(f"search {sweep_id} has no completed trial yet (switchyard status {sweep_id})")
    _, fixed = space.parse(settings.params)
    overrides = [*recorded["base"], *space.overrides(top.params, fixed)]
    run_dir = registry.job(sweep_id, top.num).run_dir
    if as_json:
        print(json.dumps({"trial": top.num, "value": top.value, "objective": settings.objective,
                          "overrides": overrides, "run_dir": run_dir}), file=out)
        return 0
    print(f"trial {top.num}: {settings.objective}={top.value:.6g}\n"
          f"overrides: {' '.join(_quoted(o) for o in overrides)}\nrun_dir: {run_dir}", file=out)
    return 0


def _quoted(text: str) -> str:
    import shlex

    return shlex.quote(text)


def cmd_resume(registry: Registry, sweep_id: int, out: IO[str] = sys.stdout) -> int:
    settings, _ = settings_of(registry, sweep_id)
    trials = registry.trials(sweep_id)
    running = sum(t.state == "RUNNING" for t in trials)
    print(f"resuming search {sweep_id}: {len(trials)} of {settings.n_trials} trials asked, {running} "
          f"running (adopted, not resubmitted)", file=out, flush=True)
    started = time.monotonic()
    resume(registry, sweep_id, out)
    print(f"search {sweep_id} ended ({time.monotonic() - started:.0f} s after the resume)", file=out)
    return 0
