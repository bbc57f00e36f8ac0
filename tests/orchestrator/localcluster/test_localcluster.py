"""The local cluster's pieces that need no running daemons: config rendering, GPU devices, the port check."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.localcluster import cluster

ROOT = Path(__file__).resolve().parents[3]


def layout(tmp_path: Path, **kw: int) -> cluster.Layout:
    return cluster.Layout(state_dir=tmp_path, hostname="host1", **kw)  # type: ignore[arg-type]


def test_slurm_conf_declares_two_nodes_on_loopback_with_state_under_state_dir(tmp_path: Path) -> None:
    text = cluster.render_slurm_conf(layout(tmp_path), cpus=2, memory_mb=1000)
    assert "NodeName=n[1-2] NodeHostname=host1 NodeAddr=127.0.0.1 Port=17001-17002 CPUs=2" in text
    assert "AccountingStorageType=accounting_storage/slurmdbd" in text
    assert "ProctrackType=proctrack/linuxproc" in text
    for line in text.splitlines():
        if line.split("=")[0] in ("StateSaveLocation", "SlurmdSpoolDir", "SlurmctldPidFile",
                                  "SlurmdPidFile", "SlurmctldLogFile", "SlurmdLogFile"):
            assert line.split("=", 1)[1].startswith(str(tmp_path)), line


def test_slurmdbd_conf_points_at_our_database(tmp_path: Path) -> None:
    text = cluster.render_slurmdbd_conf(layout(tmp_path, mysql_port=23306), "pw")
    assert "StoragePort=23306" in text and "StoragePass=pw" in text


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_taken_port_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        lay = layout(tmp_path, slurmctld_port=port, slurmdbd_port=free_port(),
                     mysql_port=free_port(), first_slurmd_port=free_port())
        with pytest.raises(cluster.ClusterError, match=f"port {port} .*slurmctld.*taken"):
            cluster.check_ports(lay)


def test_down_never_signals_a_pid_that_is_not_our_daemon(tmp_path: Path) -> None:
    lay = layout(tmp_path)
    slurmctld = cluster.daemons(lay)[3]
    slurmctld.pid_file.parent.mkdir(parents=True)
    slurmctld.pid_file.write_text("1\n")  # pid 1 is alive, but it is not slurmctld
    assert cluster.running_pid(slurmctld) is None


def test_non_root_gets_told_to_use_sudo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(cluster.ClusterError, match=r"must run as root.*sudo"):
        cluster.check_root()


def test_a_zombie_daemon_counts_as_stopped(tmp_path: Path) -> None:
    """Daemons killed with a session can linger as zombies; `up` must start them again."""
    import subprocess
    import time

    child = subprocess.Popen(["sleep", "0"])  # exits at once; not reaped until wait()
    time.sleep(0.5)
    fake = cluster.Daemon("sleep", "sleep", tmp_path / "sleep.pid", None, tmp_path / "sleep.log")
    fake.pid_file.write_text(f"{child.pid}\n")
    assert Path(f"/proc/{child.pid}/stat").read_text().split(") ")[1].startswith("Z")
    assert cluster.running_pid(fake) is None
    child.wait()
    alive = subprocess.Popen(["sleep", "30"])
    try:
        fake.pid_file.write_text(f"{alive.pid}\n")
        assert cluster.running_pid(fake) == alive.pid
    finally:
        alive.kill()
        alive.wait()


def test_nodes_advertise_gpus_as_gres_backed_by_character_devices(tmp_path: Path) -> None:
    import stat

    gpus = layout(tmp_path)  # the default: 2 per node
    text = cluster.render_slurm_conf(gpus, cpus=2, memory_mb=1000)
    assert "GresTypes=gpu" in text and "AccountingStorageTRES=gres/gpu" in text
    assert "RealMemory=1000 Gres=gpu:2 State=UNKNOWN" in text
    assert cluster.render_gres_conf(gpus).splitlines()[-1] == \
        f"NodeName=n1,n2 Name=gpu File={tmp_path}/dev/gpu[0-1]"
    cluster.make_gpu_devices(gpus)
    assert all(stat.S_ISCHR(p.stat().st_mode) for p in gpus.gpu_devices())
    plain = cluster.render_slurm_conf(layout(tmp_path, gpus_per_node=0), cpus=2, memory_mb=1000)
    assert "Gres" not in plain


def test_changing_the_gpu_count_rewrites_the_node_definition(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster, "link_etc_slurm_conf", lambda layout: None)  # /etc is not ours here
    monkeypatch.setattr(cluster, "add_hosts_entry", lambda layout: None)
    assert cluster.write_configs(layout(tmp_path)) is True
    assert cluster.write_configs(layout(tmp_path)) is False  # unchanged: nothing to restart
    assert cluster.write_configs(layout(tmp_path, gpus_per_node=4)) is True
    assert cluster.write_configs(layout(tmp_path, gpus_per_node=0)) is True
    assert not (tmp_path / "etc" / "gres.conf").exists()


def test_the_cluster_command_runs_on_the_standard_library_alone(tmp_path: Path) -> None:
    """`make test` brings the cluster up with `python3 -m orchestrator.localcluster` while the venv
    is still being built: with `-S` (no site-packages) any third-party import on its path fails."""
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-S", "-m", "orchestrator.localcluster", *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)

    status = run("status", "--state-dir", str(tmp_path))
    assert status.returncode == 3, status.stderr  # not up: no daemon of this state directory runs
    assert f"state directory: {tmp_path}" in status.stdout and "slurmctld    stopped" in status.stdout
    refused = run("up", "--gpus", "-1", "--state-dir", str(tmp_path))
    assert (refused.returncode, refused.stderr) == (2, "python3 -m orchestrator.localcluster: error: "
                                                       "--gpus -1 is invalid: must be >= 0 (try --gpus 2)\n")
    assert not any(tmp_path.iterdir())  # refused before anything was written
