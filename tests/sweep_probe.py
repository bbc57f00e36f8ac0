"""The probe Hydra app the sweep tests launch: records each run, fails on request, sleeps.

Shared by tests/orchestrator/test_sweep_local.py and tests/slurm/test_sweep_on_slurm.py
(pytest puts tests/ on sys.path; this file is not collected, it has no test_ prefix).
"""

from __future__ import annotations

import os
from pathlib import Path

APP = """
import os
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path=".", config_name="config")
def main(cfg: DictConfig) -> int:
    Path(cfg.out_dir, f"ran-{cfg.x}-{os.getpid()}").write_text(str(cfg.label))
    # what the task's process had imported for it: an app without torch should find none
    Path(cfg.out_dir, f"torch-{cfg.x}-{os.getpid()}").write_text(str("torch" in sys.modules))
    if Path(cfg.out_dir, f"fail-{cfg.x}").exists():
        raise ValueError(f"x={cfg.x} was told to fail")
    time.sleep(cfg.sleep_s)
    return int(cfg.x) * 10


if __name__ == "__main__":
    main()
"""
CONFIG = """
defaults:
  - _self_
  - override hydra/launcher: {launcher}
x: 0
sleep_s: 0
label: {label}
out_dir: {out_dir}
hydra:
{launcher_block}  sweep:
    dir: {sweep_dir}
"""


def write_app(directory: Path, *, launcher: str, label: str,
              launcher_settings: dict[str, object] | None = None) -> Path:
    """app.py + config.yaml in ``directory``; runs record themselves in ``directory/out``."""
    (directory / "out").mkdir(exist_ok=True)
    (directory / "app.py").write_text(APP)
    block = "".join(f"    {k}: {v}\n" for k, v in (launcher_settings or {}).items())
    (directory / "config.yaml").write_text(CONFIG.format(
        launcher=launcher, label=label, out_dir=directory / "out", sweep_dir=directory / "multirun",
        launcher_block=f"  launcher:\n{block}" if block else ""))
    return directory / "app.py"


def registry_env(directory: Path) -> dict[str, str]:
    """The environment with a throwaway sweep registry in ``directory``."""
    return {**os.environ, "SWITCHYARD_REGISTRY": str(directory / "registry.db")}
