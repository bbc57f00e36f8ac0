"""Where a run's metrics go: ``metrics.jsonl`` always, TensorBoard and W&B when chosen (``logger``).

Rank 0 writes, and only at log steps: the values arrive already reduced over all ranks
(``metrics.MetricsWindow``), so no backend sees one rank's view and no step that does not log
pays for logging.

Requeue-safe, also after ``kill -9`` (no checkpoint at the stop): a run that resumes from the
checkpoint of step k first drops what an earlier attempt logged after k, so every step appears
once, with the values of the attempt that the checkpoints continue:

- ``metrics.jsonl`` is rewritten (atomically) without its lines past k;
- TensorBoard keeps the same directory (``RUN/tensorboard``) and opens it with ``purge_step=k+1``:
  its reader drops the earlier attempt's events from step k+1 on;
- W&B resumes the same run, its id derived from the run directory (``wandb_id``), so a requeue
  continues one run instead of starting another (Lightning issue 13524); W&B itself refuses a
  step at or below the last it recorded, so after a crash it keeps the first attempt's values for
  the steps logged twice.

The hyperparameters (the resolved config, flattened) go in once, on a fresh start: TensorBoard's
HParams view and W&B's config then compare the points of a sweep.
"""

from __future__ import annotations

import json
import netrc
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import xxhash

from durable import atomic
from orchestrator.config import ConfigError, LoggerConfig

JSONL_NAME = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
WANDB_KEYLESS_MODES = ("offline", "dryrun", "disabled")  # WANDB_MODE values that never log in
# metrics.jsonl key -> the tag TensorBoard and W&B show it under
TAGS = {"train_loss": "train/loss", "samples_per_s": "train/samples_per_s", "lr": "train/lr",
        "grad_norm": "train/grad_norm", "peak_mem_bytes": "memory/peak_bytes",
        "eval_loss": "eval/loss", "eval_accuracy": "eval/accuracy"}


def check_available(cfg: LoggerConfig) -> None:
    """Before submission: a chosen backend that is not installed here fails now, not on rank 0."""
    for name, chosen, install in (("tensorboard", cfg.tensorboard, "pip install tensorboard"),
                                  ("wandb", cfg.wandb, "pip install 'switchyard[wandb]'")):
        if not chosen:
            continue
        try:
            __import__(name)
        except ImportError as e:
            raise ConfigError(f"logger.{name}=true but {name} is not installed ({install}, or "
                              f"logger.{name}=false)") from e
    if cfg.wandb:
        check_wandb_key(os.environ)


def check_wandb_key(environ: Mapping[str, str]) -> None:
    """W&B online needs an API key, which ``wandb.init`` looks up only on rank 0, after the queue
    wait. Looked up here where W&B looks (the environment, then the netrc file ``wandb login``
    writes), without contacting any server; offline and disabled modes need none."""
    if environ.get("WANDB_MODE", "").lower() in WANDB_KEYLESS_MODES or \
            environ.get("WANDB_DISABLED", "").lower() in ("true", "1", "yes"):
        return
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = urlsplit(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    netrc_path = netrc_file(environ)
    if netrc_path is not None and netrc_has(netrc_path, host):
        return
    where = f"no entry for {host} in {netrc_path}" if netrc_path else "no ~/.netrc"
    raise ConfigError(f"logger.wandb=true but W&B has no API key here (WANDB_API_KEY is unset, {where}), "
                      f"so rank 0 would fail after the queue wait (run `wandb login`, or export "
                      f"WANDB_API_KEY=<your key>, or WANDB_MODE=offline to log locally and `wandb sync` "
                      f"later, or logger.wandb=false)")


def netrc_file(environ: Mapping[str, str]) -> Path | None:
    """The netrc file W&B reads: ``$NETRC``, else ``~/.netrc`` (or ``~/_netrc``) if it exists."""
    if environ.get("NETRC"):
        return Path(environ["NETRC"]).expanduser()
    home = Path(environ.get("HOME") or Path.home())
    return next((p for p in (home / ".netrc", home / "_netrc") if p.is_file()), None)


def netrc_has(path: Path, host: str) -> bool:
    try:
        return netrc.netrc(str(path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False  # unreadable or malformed: W&B could not read a key from it either


def wandb_id(run_dir: Path) -> str:
    """The same W&B run for every attempt in one run directory; another run directory, another."""
    return xxhash.xxh3_64_hexdigest(str(Path(run_dir).absolute()).encode())


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1e-3}}`` -> ``{"optim.lr": 1e-3}``; values HParams cannot show as text."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return flat


class RunLog:
    """Rank 0's writers for one attempt of a run that continues after ``resume_step``."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path, resume_step: int,
                 hparams: Mapping[str, Any]) -> None:
        self.jsonl = Path(run_dir) / JSONL_NAME
        drop_after(self.jsonl, resume_step)
        self.tensorboard: Any = None
        self.wandb: Any = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(Path(run_dir) / TENSORBOARD_DIR),
                                             purge_step=resume_step + 1)
            if resume_step == 0:
                _write_hparams(self.tensorboard, hparams)
        if cfg.wandb:
            import wandb

            (Path(run_dir) / WANDB_DIR).mkdir(parents=True, exist_ok=True)
            self.wandb = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity,
                                    id=wandb_id(run_dir), resume="allow", dir=str(run_dir),
                                    name=Path(run_dir).name, config=dict(hparams))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        with open(self.jsonl, "a") as f:
            f.write(json.dumps({"step": step, **values, "t": time.time()}) + "\n")
        tagged = {TAGS.get(k, k): v for k, v in values.items()}
        if self.tensorboard is not None:
            for tag, value in tagged.items():
                if value is not None:  # a NaN loss arrives as None (strict JSON); TensorBoard raised
                    self.tensorboard.add_scalar(tag, value, step)
            self.tensorboard.flush()  # a log step is rare: a kill -9 loses nothing logged
        if self.wandb is not None:
            self.wandb.log(tagged, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def drop_after(path: Path, step: int) -> None:
    """Rewrite ``path`` (JSON lines with a ``step``) without the lines past ``step``."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return
    kept = [line for line in lines if (logged := _step_of(line)) is not None and logged <= step]
    if len(kept) != len(lines):
        atomic.write_text(path, "".join(f"{line}\n" for line in kept))


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a line a killed writer left half-written


def _write_hparams(writer: Any, hparams: Mapping[str, Any]) -> None:
    """The config into TensorBoard's HParams view, in the run's own directory (``add_hparams``
    would start a second run beside it), with the metrics it should show as columns."""
    from torch.utils.tensorboard.summary import hparams as hparams_summary

    metrics = {TAGS["train_loss"]: 0.0, TAGS["eval_loss"]: 0.0, TAGS["eval_accuracy"]: 0.0}
    for summary in hparams_summary(dict(hparams), metrics):
        writer.file_writer.add_summary(summary)
