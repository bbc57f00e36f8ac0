"""The config of ``switchyard run``: the command, and the groups it shares with ``jobs.train``."""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from orchestrator.config import (
    ClusterConfig,
    ParallelismConfig,
    TelemetryConfig,
    check_ints,
    invalid,
    register_configs,
)


@dataclass
class RunConfig:
    """``switchyard run [key=value ...] -- COMMAND...``: COMMAND as every rank of one job.

    Keys added with ``+`` (``+lr=1e-3,3e-3`` in a sweep) are the command's own values: the command
    reads them as ``${lr}``.
    """

    command: list[str] = field(default_factory=list)  # every rank's argv; filled from after `--`
    cwd: str | None = None  # where the command runs; null: the directory `switchyard run` started in
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)

    def __post_init__(self) -> None:
        check_ints(self)
        parallelism = self.parallelism
        if self.cluster.mode == "local" and parallelism.gpus_per_node and parallelism.nodes > 1:
            raise invalid("parallelism.nodes", parallelism.nodes, "GPUs in cluster=local run on this "
                          "machine, one rank per GPU", f"parallelism.nodes=1 parallelism.gpus_per_node="
                          f"{parallelism.nodes * parallelism.gpus_per_node}")
        if self.cluster.mode == "debug" and parallelism.world_size > 1:
            # As for jobs.train: debug mode is one rank in this process, to step through.
            self.parallelism = dataclasses.replace(parallelism, nodes=1, procs_per_node=1,
                                                   gpus_per_node=min(parallelism.gpus_per_node, 1))


def register_run_configs(command: list[str] | None = None) -> None:
    """Register the groups and ``run_schema`` (``conf/run.yaml`` starts from it); ``command``
    becomes its default, so a command given after ``--`` never passes through Hydra's override
    parser (quotes, commas and ``=`` in it stay as typed; ``${key}`` still resolves)."""
    register_configs()
    ConfigStore.instance().store(name="run_schema", node=RunConfig(command=list(command or [])))


def refuse_unparsable(command: list[str]) -> str | None:
    """An error for the first argument of ``command`` that OmegaConf cannot read as a value (an
    unfinished ``${``: the command is the config's ``command``, where ``${key}`` resolves), else
    None. Checked before Hydra, whose parse of it was an omegaconf traceback with exit 1."""
    from omegaconf.errors import GrammarParseError
    from omegaconf.grammar_parser import parse

    for position, arg in enumerate(command, start=1):
        try:
            parse(arg)
        except GrammarParseError:
            literal = arg.replace("${", "\\${")
            return (f"argument {position} of the command after `--` ({arg!r}) has an unfinished ${{...}}: "
                    f"a ${{key}} there is resolved from the config, so close it (${{key}}), or write "
                    f"\\${{ for a literal ${{ (try {shlex.quote(literal)})")
    return None
