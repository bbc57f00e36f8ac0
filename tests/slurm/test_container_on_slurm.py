"""A 2-node job whose ranks run inside a container that enforces its mounts.

pyxis and Apptainer cannot be installed here, and podman cannot start a container in this
sandbox (docs/containers.md says why): the job runs through ``data/apptainer-standin/apptainer``
on the job's PATH, which, like apptainer, shows the command nothing but the image and the binds.
So this checks what a cluster would: every path the job needs is mounted without being listed
(where a symlink leads included), and a path not mounted is not there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

STANDIN = Path(__file__).with_name("data") / "apptainer-standin"

PROBE = """\
import os, socket, sys
hidden = sys.argv[1]
print(f"probe rank {os.environ['SLURM_PROCID']} on {os.environ['SLURMD_NODENAME']}: "
      f"container={os.environ.get('APPTAINER_NAME')} hidden_visible={os.path.exists(hidden)} "
      f"checkout_visible={os.path.exists(sys.argv[2])}", flush=True)
"""


def test_a_two_node_job_runs_in_the_container_and_sees_only_its_mounts(
        tmp_path: Path, queued: list[str]) -> None:
    work, lib = tmp_path / "work", tmp_path / "shared-lib"
    work.mkdir()
    lib.mkdir()
    (lib / "probe.py").write_text(PROBE)
    (work / "lib").symlink_to(lib)  # the mount of work/ holds the link alone: the script is mounted too
    hidden = tmp_path / "not-mounted.txt"  # beside the submitting directory, on every node's disk
    hidden.write_text("the host has it")
    image = tmp_path / "image.sif"  # the stand-in's image: the host paths its root holds
    image.write_text("\n".join(["/usr", "/bin", "/lib", "/lib64", "/etc", sys.base_prefix, sys.prefix,
                                f"PATH={sys.prefix}/bin:/usr/bin:/bin", ""]))
    checkout = Path(__file__).parents[2]
    run_dir = work / "run"
    env = {**os.environ, "PATH": f"{STANDIN}:{os.environ['PATH']}",
           "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "run", "cluster=slurm", "parallelism.nodes=2",
             "parallelism.procs_per_node=1", "container=apptainer", f"cluster.container.image={image}",
             "telemetry.enabled=false", f"hydra.run.dir={run_dir}",
             "--", "python", "lib/probe.py", str(hidden), str(checkout / "orchestrator")],
            cwd=work, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:  # the job it queued is still cancelled at the end
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        queued.extend(re.findall(r"slurm_job_id: (\S+)", out))
        raise
    queued.extend(re.findall(r"slurm_job_id: (\S+)", proc.stdout))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    script = next((run_dir / "submitit").glob("*_submission.sh")).read_text()
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    binds = srun.split(" --bind ", 1)[1].split(" ", 1)[0].split(",")
    assert f"{work}:{work}" in binds and not any(str(hidden) in b for b in binds), srun  # run_dir is inside
    assert f"{lib}/probe.py:{lib}/probe.py" in binds, srun  # where work/lib/probe.py leads
    assert f" --pwd {work} {image} python -u -m orchestrator.launch.job_entry " in srun  # Switchyard's entry
    logs = "".join(p.read_text() for p in sorted((run_dir / "submitit").glob("*_log.out")))
    probes = sorted(re.findall(r"probe rank (\d) on (n\d): (.*)", logs))
    # Both ranks ran inside; neither saw the file the host has beside the mounted directory, nor
    # the checkout Switchyard was submitted from: its code came from the mounted snapshot.
    assert probes == [("0", "n1", "container=image.sif hidden_visible=False checkout_visible=False"),
                      ("1", "n2", "container=image.sif hidden_visible=False checkout_visible=False")], logs
