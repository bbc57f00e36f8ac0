"""The launchers' config schemas, registered under ``hydra/launcher`` when Hydra scans its plugins.

Every field is documented on :class:`orchestrator.sweeps.arrays.LauncherSettings`; these classes add the
``_target_`` Hydra instantiates and the defaults that differ between the two launchers.
"""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

from orchestrator.sweeps.arrays import LauncherSettings

LAUNCHER = "hydra_plugins.switchyard_launcher.launcher.SwitchyardLauncher"


@dataclass
class SwitchyardSlurmConf(LauncherSettings):
    """One ``sbatch --array`` per group of points with equal resources."""

    _target_: str = LAUNCHER
    executor: str = "slurm"
    job_name: str = "${hydra.job.name}"


@dataclass
class SwitchyardLocalConf(LauncherSettings):
    """Processes on this machine; blocking runs at most ``array_parallelism`` points at once."""

    _target_: str = LAUNCHER
    executor: str = "local"
    array_parallelism: int = 1  # each point is already a multi-process DDP job
    job_name: str = "${hydra.job.name}"


ConfigStore.instance().store(group="hydra/launcher", name="switchyard_slurm", node=SwitchyardSlurmConf,
                             provider="switchyard")
ConfigStore.instance().store(group="hydra/launcher", name="switchyard_local", node=SwitchyardLocalConf,
                             provider="switchyard")
