"""A real SLURM cluster on one machine: munged, MariaDB, slurmdbd, slurmctld and two slurmd nodes.

Everything lives under one state directory (config, spool, pid files, logs, the database); the only
things written outside it are what the daemons and clients cannot do without:

- ``/etc/slurm/slurm.conf``: a symlink to our config, so every SLURM client (``sbatch``, ``sinfo``,
  submitit) finds the cluster without ``SLURM_CONF`` in its environment;
- one marked line in ``/etc/hosts`` so the node names ``n1``/``n2`` resolve (submitit takes
  MASTER_ADDR from the node list; an unresolvable name makes torch retry for 30 minutes);
- ``/run/munge`` (munged's socket directory).

``down`` stops only the daemons whose pid files are in our state directory, and only after checking
that the pid still belongs to the daemon we started (a recycled pid is left alone).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_STATE_DIR = Path("/var/lib/switchyard/cluster")
STATE_DIR_ENV = "SWITCHYARD_CLUSTER_DIR"
APT_PACKAGES = ("slurm-wlm", "slurmdbd", "munge", "mariadb-server")
REQUIRED_BINARIES = ("slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd", "sacctmgr", "sinfo")
ETC_SLURM_CONF = Path("/etc/slurm/slurm.conf")
HOSTS_FILE = Path("/etc/hosts")
HOSTS_MARKER = "# switchyard local cluster"
DB_NAME = "slurm_acct_db"
DB_USER = "slurm"
# GPUs each node advertises as GRES. No hardware: each "GPU" is a character device with /dev/null's
# numbers; SLURM binds them per task all the same (CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS), and that
# binding is what Switchyard's GPU path reads. 2 per node: one per task of a 2 x 2 job.
DEFAULT_GPUS_PER_NODE = 2


class ClusterError(RuntimeError):
    """Bringing the local cluster up or down failed; the message says what to do."""


@dataclass(frozen=True)
class Layout:
    """Where everything of the local cluster lives, and which ports it uses."""

    state_dir: Path
    cluster_name: str = "switchyard"
    node_names: tuple[str, ...] = ("n1", "n2")
    slurmctld_port: int = 6817
    slurmdbd_port: int = 6819
    first_slurmd_port: int = 17001
    mysql_port: int = 13306
    hostname: str = field(default_factory=socket.gethostname)
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE

    @property
    def gres_conf(self) -> Path:
        return self.state_dir / "etc" / "gres.conf"  # slurmd reads it beside slurm.conf

    def gpu_devices(self) -> list[Path]:
        return [self.state_dir / "dev" / f"gpu{i}" for i in range(self.gpus_per_node)]

    @property
    def slurm_conf(self) -> Path:
        return self.state_dir / "etc" / "slurm.conf"

    @property
    def slurmdbd_conf(self) -> Path:
        return self.state_dir / "etc" / "slurmdbd.conf"

    @property
    def run_dir(self) -> Path:
        return self.state_dir / "run"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "log"

    @property
    def mysql_dir(self) -> Path:
        return self.state_dir / "mysql"

    @property
    def munge_dir(self) -> Path:
        # munged runs as the munge user and must own the directory of its pid file.
        return self.state_dir / "munge"

    @property
    def db_password_file(self) -> Path:
        return self.state_dir / "etc" / "db_password"

    def slurmd_port(self, node: str) -> int:
        return self.first_slurmd_port + self.node_names.index(node)

    @classmethod
    def from_env(cls, state_dir: str | os.PathLike[str] | None = None,
                 gpus_per_node: int = DEFAULT_GPUS_PER_NODE) -> Layout:
        chosen = state_dir or os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR
        return cls(state_dir=Path(chosen).absolute(), gpus_per_node=gpus_per_node)


@dataclass(frozen=True)
class Daemon:
    """One process we start and later stop by its pid file."""

    name: str  # shown to the user
    comm: str  # /proc/PID/comm of the running daemon, checked before we signal it
    pid_file: Path
    port: int | None
    log_file: Path


def daemons(layout: Layout) -> list[Daemon]:
    """The daemons in start order (``down`` stops them in reverse)."""
    run, log = layout.run_dir, layout.log_dir
    result = [
        Daemon("munged", "munged", layout.munge_dir / "munged.pid", None, layout.munge_dir / "munged.log"),
        Daemon("mariadb", "mariadbd", layout.mysql_dir / "mariadbd.pid", layout.mysql_port,
               log / "mariadb.log"),
        Daemon("slurmdbd", "slurmdbd", run / "slurmdbd.pid", layout.slurmdbd_port, log / "slurmdbd.log"),
        Daemon("slurmctld", "slurmctld", run / "slurmctld.pid", layout.slurmctld_port,
               log / "slurmctld.log"),
    ]
    for node in layout.node_names:
        result.append(Daemon(f"slurmd {node}", "slurmd", run / f"slurmd-{node}.pid",
                             layout.slurmd_port(node), log / f"slurmd-{node}.log"))
    return result


# ----------------------------------------------------------------------------------------------
# Small process helpers


def _run(cmd: Sequence[str], *, check: bool = True, input_text: str | None = None,
         timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, input=input_text,
                              timeout=timeout_s, check=False)
    except FileNotFoundError as e:
        raise ClusterError(f"{cmd[0]} is not installed: run `switchyard cluster up` as root, "
                           f"it installs {' '.join(APT_PACKAGES)}") from e
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
    return proc


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _comm(pid: int) -> str | None:
    """The live process's name, or None when it is gone or a zombie (dead, waiting to be reaped:
    a daemon killed with its session can linger like that, and must count as stopped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "PID (COMM) STATE ...": COMM may hold spaces or parentheses, so split at the last ")".
    comm, _, rest = stat.partition(" (")[2].rpartition(")")
    if rest.split()[:1] == ["Z"]:
        return None
    return comm


def running_pid(daemon: Daemon) -> int | None:
    """The daemon's pid if its pid file names a live process that is that daemon, else None."""
    pid = read_pid(daemon.pid_file)
    if pid is None:
        return None
    comm = _comm(pid)
    # comm is cut at 15 characters by the kernel.
    if comm is None or not daemon.comm.startswith(comm[:15]):
        return None
    return pid


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def port_is_listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def wait_for(what: str, ready: Callable[[], bool], timeout_s: float, log_file: Path | None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.25)
    raise ClusterError(f"{what} did not become ready within {timeout_s:.0f} s.{_log_tail(log_file)}")


def _log_tail(log_file: Path | None, lines: int = 15) -> str:
    if log_file is None or not log_file.exists():
        return ""
    tail = log_file.read_text(errors="replace").splitlines()[-lines:]
    return f"\nLast lines of {log_file}:\n  " + "\n  ".join(tail)


# ----------------------------------------------------------------------------------------------
# Preconditions


def check_root() -> None:
    if os.geteuid() != 0:
        raise ClusterError("switchyard cluster must run as root: it starts munged, MariaDB and the "
                           "SLURM daemons and edits /etc/hosts. Run it with sudo.")


def ensure_packages(install: bool = True) -> None:
    missing = [b for b in REQUIRED_BINARIES if _which(b) is None]
    if not missing:
        return
    if not install or shutil.which("apt-get") is None:
        raise ClusterError(f"missing programs: {', '.join(missing)}. Install the Debian packages "
                           f"{' '.join(APT_PACKAGES)} (apt-get install -y {' '.join(APT_PACKAGES)}).")
    print(f"installing {' '.join(APT_PACKAGES)} (missing: {', '.join(missing)}) ...", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *APT_PACKAGES]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            raise ClusterError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}); install "
                               f"{' '.join(APT_PACKAGES)} by hand and run up again:\n"
                               f"{proc.stderr.strip()[-2000:]}")
    still = [b for b in REQUIRED_BINARIES if _which(b) is None]
    if still:
        raise ClusterError(f"after apt-get install, still missing: {', '.join(still)}")


def _which(binary: str) -> str | None:
    # Debian puts the daemons in /usr/sbin, which a non-login root shell may lack on PATH.
    return shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/sbin")


def check_ports(layout: Layout) -> None:
    """Refuse to start when a port we need is held by a program that is not ours."""
    for daemon in daemons(layout):
        if daemon.port is None or running_pid(daemon) is not None:
            continue
        if not port_is_free(daemon.port):
            raise ClusterError(
                f"port {daemon.port} on 127.0.0.1, needed by {daemon.name}, is taken by another "
                f"program (see `ss -ltnp 'sport = :{daemon.port}'`). Stop that program, or run "
                f"`switchyard cluster down` if it is a cluster started with another state directory.")


# ----------------------------------------------------------------------------------------------
# Configuration files


def node_memory_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    raise ClusterError("cannot read MemTotal from /proc/meminfo")


def render_slurm_conf(layout: Layout, cpus: int, memory_mb: int) -> str:
    nodes = layout.node_names
    node_range = f"n[1-{len(nodes)}]" if nodes == tuple(f"n{i + 1}" for i in range(len(nodes))) \
        else ",".join(nodes)
    last_port = layout.first_slurmd_port + len(nodes) - 1
    s = layout.state_dir
    # sacct's AllocTRES then shows gres/gpu=N per job, as on a real GPU cluster
    gres_types = "GresTypes=gpu\nAccountingStorageTRES=gres/gpu\n" if layout.gpus_per_node else ""
    gres = f" Gres=gpu:{layout.gpus_per_node}" if layout.gpus_per_node else ""
    return f"""\
# Written by `switchyard cluster up`; edits are overwritten.
ClusterName={layout.cluster_name}
SlurmctldHost={layout.hostname}(127.0.0.1)
SlurmctldPort={layout.slurmctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={s}/slurmctld
SlurmdSpoolDir={s}/slurmd/%n
SlurmctldPidFile={layout.run_dir}/slurmctld.pid
SlurmdPidFile={layout.run_dir}/slurmd-%n.pid
SlurmctldLogFile={layout.log_dir}/slurmctld.log
SlurmdLogFile={layout.log_dir}/slurmd-%n.log
# No cgroups on these machines: track processes through /proc, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={layout.slurmdbd_port}
JobCompType=jobcomp/none
{gres_types}KillWait=5
InactiveLimit=0
MinJobAge=300
SlurmctldTimeout=60
SlurmdTimeout=60
MessageTimeout=30
NodeName={node_range} NodeHostname={layout.hostname} NodeAddr=127.0.0.1 \
Port={layout.first_slurmd_port}-{last_port} CPUs={cpus} RealMemory={memory_mb}{gres} State=UNKNOWN
PartitionName=debug Nodes={node_range} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def render_gres_conf(layout: Layout) -> str:
    devices = layout.gpu_devices()
    files = f"{devices[0].parent}/gpu[0-{len(devices) - 1}]" if len(devices) > 1 else str(devices[0])
    return f"""\
# Written by `switchyard cluster up`; edits are overwritten.
NodeName={",".join(layout.node_names)} Name=gpu File={files}
"""


def make_gpu_devices(layout: Layout) -> None:
    """One character device per advertised GPU, with /dev/null's numbers (1, 3): nothing to drive."""
    for path in layout.gpu_devices():
        if path.exists() and stat.S_ISCHR(path.stat().st_mode):
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))


def render_slurmdbd_conf(layout: Layout, db_password: str) -> str:
    return f"""\
# Written by `switchyard cluster up`; edits are overwritten.
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={layout.slurmdbd_port}
SlurmUser=root
PidFile={layout.run_dir}/slurmdbd.pid
LogFile={layout.log_dir}/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={layout.mysql_port}
StorageUser={DB_USER}
StoragePass={db_password}
StorageLoc={DB_NAME}
"""


def _write_if_changed(path: Path, text: str, mode: int = 0o644) -> bool:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.read_text() == text:
        os.chmod(path, mode)
        return False
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    return True


def _db_password(layout: Layout) -> str:
    if layout.db_password_file.exists():
        return layout.db_password_file.read_text().strip()
    password = os.urandom(12).hex()
    _write_if_changed(layout.db_password_file, password + "\n", 0o600)
    return password


def write_configs(layout: Layout) -> bool:
    """Write every config file; True when slurm.conf or gres.conf changed (the daemons must restart)."""
    for sub in ("etc", "run", "log", "slurmctld", "slurmd"):
        (layout.state_dir / sub).mkdir(parents=True, exist_ok=True)
    cpus = os.cpu_count() or 1
    changed = _write_if_changed(layout.slurm_conf, render_slurm_conf(layout, cpus, node_memory_mb()))
    if layout.gpus_per_node:
        make_gpu_devices(layout)
        changed |= _write_if_changed(layout.gres_conf, render_gres_conf(layout))
    elif layout.gres_conf.exists():
        layout.gres_conf.unlink()
        changed = True
    _write_if_changed(layout.slurmdbd_conf, render_slurmdbd_conf(layout, _db_password(layout)), 0o600)
    link_etc_slurm_conf(layout)
    add_hosts_entry(layout)
    return changed


def link_etc_slurm_conf(layout: Layout) -> None:
    """Point /etc/slurm/slurm.conf at our config, refusing to replace a config that is not ours."""
    target = layout.slurm_conf
    if ETC_SLURM_CONF.is_symlink():
        if Path(os.readlink(ETC_SLURM_CONF)) == target:
            return
        current = os.readlink(ETC_SLURM_CONF)
        if not str(current).endswith("/etc/slurm.conf") or "switchyard" not in str(current):
            raise ClusterError(f"{ETC_SLURM_CONF} links to {current}, not to this cluster. Remove the "
                               f"link if that cluster is gone, then run up again.")
        ETC_SLURM_CONF.unlink()
    elif ETC_SLURM_CONF.exists():
        raise ClusterError(f"{ETC_SLURM_CONF} already exists and belongs to another SLURM setup. "
                           f"Move it away (e.g. to {ETC_SLURM_CONF}.orig), then run up again.")
    ETC_SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
    ETC_SLURM_CONF.symlink_to(target)


def add_hosts_entry(layout: Layout) -> None:
    names = set(layout.node_names)
    unresolved = [n for n in sorted(names) if not _resolves(n)]
    if not unresolved:
        return
    line = f"127.0.0.1 {' '.join(layout.node_names)}  {HOSTS_MARKER}\n"
    text = HOSTS_FILE.read_text() if HOSTS_FILE.exists() else ""
    if line not in text:
        with open(HOSTS_FILE, "a") as f:
            f.write(("" if text.endswith("\n") or not text else "\n") + line)
    still = [n for n in sorted(names) if not _resolves(n)]
    if still:
        raise ClusterError(f"node names {still} still do not resolve after adding them to "
                           f"{HOSTS_FILE}; check /etc/nsswitch.conf lists 'files' for hosts.")


def _resolves(name: str) -> bool:
    try:
        socket.gethostbyname(name)
    except OSError:
        return False
    return True


# ----------------------------------------------------------------------------------------------
# Starting each daemon


def start_munged(layout: Layout, daemon: Daemon) -> None:
    if _run(["bash", "-c", "munge -n | unmunge"], check=False).returncode == 0:
        return  # a munged is already serving credentials (ours or the system's): reuse it
    for d in (Path("/run/munge"), layout.munge_dir):
        d.mkdir(parents=True, exist_ok=True)
        shutil.chown(d, "munge", "munge")
    _run(["runuser", "-u", "munge", "--", _which("munged") or "munged",
          f"--pid-file={daemon.pid_file}", f"--log-file={daemon.log_file}"])
    wait_for("munged", lambda: _run(["bash", "-c", "munge -n | unmunge"], check=False).returncode == 0,
             20, daemon.log_file)


def start_mariadb(layout: Layout, daemon: Daemon) -> None:
    datadir = layout.mysql_dir / "data"
    socket_path = layout.mysql_dir / "mysqld.sock"
    if not (datadir / "mysql").exists():
        layout.mysql_dir.mkdir(parents=True, exist_ok=True)
        shutil.chown(layout.mysql_dir, "mysql", "mysql")
        _run(["mariadb-install-db", "--user=mysql", f"--datadir={datadir}",
              "--auth-root-authentication-method=socket", "--skip-test-db"], timeout_s=300)
    daemon.log_file.parent.mkdir(parents=True, exist_ok=True)
    # The log file must be writable by the mysql user.
    daemon.log_file.touch()
    shutil.chown(daemon.log_file, "mysql", "mysql")
    log = open(daemon.log_file, "a")  # noqa: SIM115 - handed to the detached daemon
    subprocess.Popen(
        [_which("mariadbd") or "mariadbd", "--no-defaults", "--user=mysql", f"--datadir={datadir}",
         f"--socket={socket_path}", f"--pid-file={daemon.pid_file}", "--bind-address=127.0.0.1",
         f"--port={layout.mysql_port}", f"--log-error={daemon.log_file}"],
        stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    wait_for("MariaDB", lambda: socket_path.exists() and port_is_listening(layout.mysql_port), 60,
             daemon.log_file)
    password = _db_password(layout)
    sql = (f"CREATE DATABASE IF NOT EXISTS {DB_NAME};"
           + "".join(f"CREATE USER IF NOT EXISTS '{DB_USER}'@'{h}' IDENTIFIED BY '{password}';"
                     f"GRANT ALL ON {DB_NAME}.* TO '{DB_USER}'@'{h}';"
                     for h in ("localhost", "127.0.0.1"))
           + "FLUSH PRIVILEGES;")
    _run(["mariadb", f"--socket={socket_path}", "-u", "root"], input_text=sql)


def start_slurmdbd(layout: Layout, daemon: Daemon) -> None:
    # slurmdbd looks for slurmdbd.conf beside SLURM_CONF: point it at our directory.
    proc = subprocess.run([_which("slurmdbd") or "slurmdbd"], capture_output=True, text=True,
                          env={**os.environ, "SLURM_CONF": str(layout.slurm_conf)},
                          check=False, timeout=30)
    if proc.returncode != 0:
        raise ClusterError(f"slurmdbd failed to start: {proc.stderr.strip()}"
                           f"{_log_tail(daemon.log_file)}")
    wait_for("slurmdbd", lambda: port_is_listening(layout.slurmdbd_port), 60, daemon.log_file)
    clusters = _run(["sacctmgr", "-n", "-P", "show", "cluster", "format=cluster"]).stdout.split()
    if layout.cluster_name not in clusters:
        _run(["sacctmgr", "-i", "add", "cluster", layout.cluster_name])


def start_slurmctld(layout: Layout, daemon: Daemon) -> None:
    _run([_which("slurmctld") or "slurmctld", "-f", str(layout.slurm_conf)])
    wait_for("slurmctld", lambda: _run(["scontrol", "ping"], check=False).returncode == 0, 60,
             daemon.log_file)


def start_slurmd(layout: Layout, daemon: Daemon) -> None:
    node = daemon.name.split()[-1]
    (layout.state_dir / "slurmd" / node).mkdir(parents=True, exist_ok=True)
    _run([_which("slurmd") or "slurmd", "-f", str(layout.slurm_conf), "-N", node])
    wait_for(daemon.name, lambda: port_is_listening(layout.slurmd_port(node)), 30, daemon.log_file)


def _starter(daemon: Daemon) -> Callable[[Layout, Daemon], None]:
    return {"munged": start_munged, "mariadbd": start_mariadb, "slurmdbd": start_slurmdbd,
            "slurmctld": start_slurmctld, "slurmd": start_slurmd}[daemon.comm]


# ----------------------------------------------------------------------------------------------
# The three verbs


def up(layout: Layout, *, install: bool = True, timeout_s: float = 120) -> None:
    """Bring the cluster up; harmless when it is already up."""
    check_root()
    ensure_packages(install=install)
    check_ports(layout)
    if write_configs(layout):
        restart_slurm(layout)
    for daemon in daemons(layout):
        if running_pid(daemon) is not None:
            continue
        print(f"starting {daemon.name} ...", flush=True)
        _starter(daemon)(layout, daemon)
    wait_until_ready(layout, timeout_s)


def restart_slurm(layout: Layout) -> None:
    """The node definition changed (GPUs added or removed): slurmctld and every slurmd must reread it.

    They are stopped here and started again by ``up``; munged, MariaDB and slurmdbd keep running.
    """
    for daemon in reversed(daemons(layout)):
        pid = running_pid(daemon)
        if pid is not None and daemon.comm in ("slurmd", "slurmctld"):
            print(f"restarting {daemon.name}: the cluster's node definition changed", flush=True)
            _terminate(pid, 20)
            daemon.pid_file.unlink(missing_ok=True)


def nodes_idle(layout: Layout) -> bool:
    proc = _run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
    if proc.returncode != 0:
        return False
    states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
    return all(states.get(n, "").rstrip("*") in ("idle", "mix", "alloc") and
               not states[n].endswith("*") for n in layout.node_names)


def wait_until_ready(layout: Layout, timeout_s: float) -> None:
    # A node left DOWN by an earlier unclean stop needs resuming; ReturnToService covers the rest.
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if nodes_idle(layout):
            break
        _resume_down_nodes(layout)
        time.sleep(0.5)
    else:
        raise ClusterError(f"nodes {', '.join(layout.node_names)} are not idle after {timeout_s:.0f} s "
                           f"(sinfo: {_run(['sinfo', '-h', '-N'], check=False).stdout.strip()})."
                           f"{_log_tail(layout.log_dir / 'slurmctld.log')}")
    wait_for("sacct", lambda: _run(["sacct", "-n", "-X", "-S", "now-1minute"], check=False)
             .returncode == 0, 30, layout.log_dir / "slurmdbd.log")


def _resume_down_nodes(layout: Layout) -> None:
    proc = _run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].rstrip("*") in ("down", "drain", "drng"):
            _run(["scontrol", "update", f"NodeName={parts[0]}", "State=RESUME"], check=False)


def status(layout: Layout) -> tuple[bool, str]:
    """(all up, human-readable report)."""
    lines = [f"state directory: {layout.state_dir}"]
    all_up = True
    for daemon in daemons(layout):
        pid = running_pid(daemon)
        if daemon.comm == "munged" and pid is None:
            shared = _run(["bash", "-c", "munge -n | unmunge"], check=False).returncode == 0
            lines.append(f"  {daemon.name:<12} {'running (not started by us)' if shared else 'stopped'}")
            all_up &= shared
            continue
        port = f"port {daemon.port}" if daemon.port else ""
        state = f"running  pid {pid:<7} {port}" if pid else "stopped"
        lines.append(f"  {daemon.name:<12} {state}")
        all_up &= pid is not None
    if running_pid(daemons(layout)[3]) is not None:
        sinfo = _run(["sinfo", "-N", "-o", "%N %P %t %c %m %G"], check=False).stdout.rstrip()
        lines += ["", sinfo]
    return all_up, "\n".join(lines)


def down(layout: Layout, timeout_s: float = 20) -> list[str]:
    """Stop the daemons we started (by pid file, never by name); returns their names."""
    check_root()
    stopped = []
    for daemon in reversed(daemons(layout)):
        pid = running_pid(daemon)
        if pid is None:
            daemon.pid_file.unlink(missing_ok=True)
            continue
        _terminate(pid, timeout_s)
        daemon.pid_file.unlink(missing_ok=True)
        stopped.append(daemon.name)
    return stopped


def _terminate(pid: int, timeout_s: float) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _comm(pid) is None:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
