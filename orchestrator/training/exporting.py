"""``checkpoint.export=hf|safetensors``: every ``export_every``-th checkpoint (and the last one)
exported while the training goes on, by rank 0, off the step loop.

When a due checkpoint is published, rank 0 hard-links its files into ``RUN/exports/.source-step-N``
(a copy where the checkpoint directory is on another file system) and queues the step: the loop
pays for the links, never for reading the checkpoint. A worker thread runs ``python -m
orchestrator.export`` on the links in a subprocess, one at a time, at a lower CPU priority and
without a GPU: it rebuilds the model on the host (an fsdp checkpoint's shards read tensor by
tensor: no rank gathers the model), writes ``RUN/exports/step-N-FORMAT`` through a temp directory
renamed whole, reloads it and compares its logits with the checkpoint's, and records that in its
``export.json``. The links keep the checkpoint's bytes while ``keep_last`` prunes the checkpoint
itself. Due steps are exported in order; when exports fall behind and ``MAX_WAITING`` steps
already wait, the oldest waiting one is dropped (counted as skipped: its links, the disk a
pruned checkpoint still holds, are freed). The end of the run waits for the exports queued.
At a preemption stop the running export is ended: it leaves no export behind, only a partial
directory the next start removes.

``checkpoint.keep_exports``: null, an export is pruned once its checkpoint is; N, the newest N
exports are kept whatever ``keep_last`` prunes.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from orchestrator.config import CheckpointConfig, ConfigError
from orchestrator.training import checkpoint

EXPORTS_DIR = "exports"
MAX_WAITING = 2  # due steps waiting beside the one exporting; an older one is dropped for a newer
_PUBLISHED = re.compile(r"^step-(\d{9})-(hf|safetensors)$")
# transformers' PreTrainedModel and Switchyard's model=gpt (GPT2LMHeadModel): what --format hf writes
_HF_CLASSES = ("transformers.modeling_utils.PreTrainedModel", "jobs.models.GPT")


def check_exportable(cfg: CheckpointConfig, model: nn.Module) -> None:
    """Before submission: ``checkpoint.export=hf`` of a model transformers cannot represent, or
    without transformers installed, is refused (the export itself checks the details)."""
    if cfg.export != "hf":
        return
    classes = {f"{c.__module__}.{c.__qualname__}" for c in type(model).__mro__}
    if not classes & set(_HF_CLASSES):
        name = f"{type(model).__module__}.{type(model).__qualname__}"
        raise ConfigError(f"checkpoint.export=hf is invalid for model {name}: transformers can represent "
                          f"a PreTrainedModel, and model=gpt as GPT2LMHeadModel, not this model (try "
                          f"checkpoint.export=safetensors)")
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ConfigError("checkpoint.export=hf needs transformers, which is not installed (pip install "
                          "'switchyard[hf]', or try checkpoint.export=safetensors)") from e


@dataclass
class ExportStats:
    """What exporting cost this run and what it made: summary.json's ``exports``."""

    exported: list[int] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # "step N: why"
    skipped: list[int] = field(default_factory=list)  # superseded by a newer due step
    loop_s: float = 0.0  # the step loop's share: staging links, queueing (blocking saves only)
    export_s: list[float] = field(default_factory=list)  # each subprocess, start to end
    end_wait_s: float = 0.0  # the end of the run waiting for the last export

    def as_summary(self) -> dict[str, Any]:
        return {"exported_steps": self.exported, "failed": self.failed, "skipped_steps": self.skipped,
                "loop_s": self.loop_s, "export_s": self.export_s, "end_wait_s": self.end_wait_s}


class Exporter:
    """Rank 0's: ``saved`` after every published checkpoint (any thread), ``finish`` at the end,
    ``abandon`` at a stop."""

    def __init__(self, cfg: CheckpointConfig, run_dir: Path, checkpoint_dir: Path, max_steps: int) -> None:
        assert cfg.export is not None  # the trainer makes one only then
        self.cfg, self.fmt, self.run_dir = cfg, cfg.export, run_dir
        self.directory, self.checkpoint_dir, self.max_steps = run_dir / EXPORTS_DIR, checkpoint_dir, max_steps
        self.stats = ExportStats()
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".*"):  # a killed run's staged links and partial exports
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
        self.waiting: list[tuple[int, Path]] = []  # (step, staged checkpoint), oldest first
        self.closed = False  # finish or abandon: nothing more is queued
        self.changed = threading.Condition()
        self.lock = threading.Lock()  # pruning from the saving thread and the worker
        self.process: subprocess.Popen[bytes] | None = None
        self.worker = threading.Thread(target=self._work, name="exporter", daemon=True)
        self.worker.start()

    def due(self, step: int) -> bool:
        every = self.cfg.every_steps * self.cfg.export_every
        return step == self.max_steps or (every > 0 and step % every == 0)

    def saved(self, step: int, path: Path, on_loop: bool) -> None:
        """``path`` (step ``step``) is published: staged and queued if due. Never raises: an export
        that cannot start is a warning, not the training's failure."""
        started = time.perf_counter()
        try:
            if self.due(step):
                self._queue(step, self._stage(step, path))
            self.prune()
        except OSError as e:
            self.stats.failed.append(f"step {step}: could not stage {path}: {e}")
        if on_loop:
            self.stats.loop_s += time.perf_counter() - started

    def _stage(self, step: int, path: Path) -> Path:
        """Hard links of the checkpoint's files (a copy across file systems): ``keep_last`` may
        delete the checkpoint while its export reads them."""
        staged = self.directory / f".source-step-{step:09d}" / path.name
        shutil.rmtree(staged.parent, ignore_errors=True)
        staged.parent.mkdir(parents=True)
        files = [path, checkpoint.checksum_path(path)] if path.is_file() else [path]
        for source in files:
            if source.is_dir():
                shutil.copytree(source, staged.parent / source.name, copy_function=_link_or_copy)
            elif source.exists():
                _link_or_copy(str(source), str(staged.parent / source.name))
        return staged

    def _queue(self, step: int, staged: Path) -> None:
        with self.changed:
            self.waiting.append((step, staged))
            if len(self.waiting) > MAX_WAITING:
                dropped, links = self.waiting.pop(0)
                self.stats.skipped.append(dropped)
                shutil.rmtree(links.parent, ignore_errors=True)
            self.changed.notify()

    def _next(self) -> tuple[int, Path] | None:
        """The oldest waiting step; None once closed and nothing waits (or when abandoned)."""
        with self.changed:
            while not self.waiting and not self.closed:
                self.changed.wait()
            return self.waiting.pop(0) if self.waiting else None

    def _work(self) -> None:
        while (item := self._next()) is not None:
            self._export(*item)

    def _export(self, step: int, staged: Path) -> None:
        out = self.directory / f"step-{step:09d}-{self.fmt}"
        log = self.directory / "logs" / f"{out.name}.log"
        log.parent.mkdir(exist_ok=True)
        command = [sys.executable, "-m", "orchestrator.export", str(self.run_dir), str(out),
                   "--format", self.fmt, "--checkpoint", str(staged), "--overwrite",
                   "--recorded-as", str(self.checkpoint_dir / staged.name),
                   "--max-shard-mb", str(self.cfg.export_shard_mb)]
        started = time.perf_counter()
        try:
            with open(log, "wb") as f:
                self.process = subprocess.Popen(_lower_priority(command), stdout=f, stderr=subprocess.STDOUT,
                                                env=_env(), start_new_session=True)
                code = self.process.wait()
        except OSError as e:
            code, self.process = -1, None
            self.stats.failed.append(f"step {step}: {e}")
        finally:
            shutil.rmtree(staged.parent, ignore_errors=True)
        self.stats.export_s.append(time.perf_counter() - started)
        if code == 0:
            self.stats.exported.append(step)
        elif code > 0:
            self.stats.failed.append(f"step {step}: exit {code}: {_last_line(log)} (log: {log})")
            print(f"warning: the export of step {step} failed: {_last_line(log)} (log: {log})", flush=True)
        self.prune()

    def prune(self) -> None:
        """Exports of pruned checkpoints (``keep_exports`` null), or beyond the newest N."""
        with self.lock:
            published = sorted(((int(m.group(1)), p) for p in self.directory.iterdir()
                                if (m := _PUBLISHED.match(p.name))), reverse=True)
            if self.cfg.keep_exports is not None:
                doomed = [p for _, p in published[self.cfg.keep_exports:]]
            else:
                kept = {step for step, _ in checkpoint.listed(self.checkpoint_dir)}
                doomed = [p for step, p in published if step not in kept]
            for path in doomed:
                shutil.rmtree(path, ignore_errors=True)

    def finish(self) -> None:
        """At the end: the queued export runs to its end (the job must not outlive its process)."""
        started = time.perf_counter()
        self._close(drop=False)
        self.worker.join()
        self.stats.end_wait_s += time.perf_counter() - started

    def abandon(self) -> None:
        """At a stop: nothing more is exported; the running export is ended (it publishes nothing)."""
        self._close(drop=True)
        process = self.process
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        self.worker.join(timeout=30)


    def _close(self, drop: bool) -> None:
        with self.changed:
            self.closed = True
            if drop:
                for step, links in self.waiting:
                    self.stats.skipped.append(step)
                    shutil.rmtree(links.parent, ignore_errors=True)
                self.waiting.clear()
            self.changed.notify()


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system, or links not allowed there
        shutil.copy2(source, target)


def _env() -> dict[str, str]:
    """The export imports the code this rank imports (its snapshot, the user's model) and no GPU."""
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "CUDA_VISIBLE_DEVICES": ""}


def _lower_priority(command: list[str]) -> list[str]:
    """Under ``nice``: the training's ranks and data workers come first on the node's CPUs (not
    ``preexec_fn``, which may deadlock a process with threads)."""
    nice = shutil.which("nice")
    return [nice, "-n", "10", *command] if nice else command


def _last_line(log: Path) -> str:
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][:300] if lines else "(empty log)"
