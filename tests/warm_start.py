"""``python -m MODULE ARGS`` for tests, forked from a warm process instead of started cold.

Each ``python -m jobs.train`` a test starts spends about 1.5 s of CPU importing torch, Hydra and
Switchyard before it reads its first override, and the suite starts well over a hundred of them on
two cores. A pytest worker starts one *zygote* the first time it needs one: a process that has
imported those modules and done nothing else (no thread, no torch operation, no CUDA). Each request
forks it; the child takes the test's command line, environment, working directory and pipes, then
runs the module as ``python -m`` would (``runpy``, as ``__main__``) and exits as the interpreter
would: the same stdout, stderr and exit status, read by the test as ``subprocess.run`` reads them.

What a fork cannot give, a cold process gets: ``run_module`` starts one (``subprocess.run``)
whenever the test's environment differs from the zygote's in a variable that may be read at import
time (``PYTHONPATH``, a ``TORCH_`` or thread setting, ``HOME``, ...: anything not in ``WARM_SAFE``),
and ``SWITCHYARD_TEST_COLD=1`` starts every one cold. Tests that signal the process, or look for it
by its command line, start it themselves (``subprocess.Popen``); the exit code and one-line format
of each entry point keep a test of their own in a cold process.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

# What the zygote imports: everything ``python -m jobs.train`` imports before its first line.
WARM_IMPORTS = ("jobs.train",)
# The zygote keeps what a local job's controller imports for its ranks, too (every strategy's
# ``rank_process.rank_modules``): a run's controller is forked from its submitter
# (``fork_start.ControllerTemplate``), so in tests it imports none of it again (about 2.5 s of CPU
# per local job, most of it torch._dynamo, which DDP's constructor imports).
# Variables that nothing reads at import time, so a test may set them for a warm process:
# Switchyard's (read when used: no module reads the environment at import), wandb's, PATH (where
# subprocess looks up scontrol), a test's fault hook, and pytest's per-test name. A variable a
# test's own model or hook reads is named SWITCHYARD_TEST_*, so it keeps the run warm.
WARM_SAFE_PREFIXES = ("SWITCHYARD_", "WANDB_")
WARM_SAFE = frozenset({"PATH", "FAIL_RANK", "PYTEST_CURRENT_TEST"})


def run_module(module: str, args: Sequence[str], *, cwd: Path | str | None = None,
               env: Mapping[str, str] | None = None, timeout: float = 600,
               ) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, -m, module, *args], capture_output=True, text=True, ...)``, forked
    from this worker's zygote where that changes nothing the process could see."""
    full_env = dict(os.environ if env is None else env)
    where = str(Path(cwd) if cwd is not None else Path.cwd())
    command = [sys.executable, "-m", module, *args]
    zygote = _zygote() if module in WARM_IMPORTS and os.environ.get("SWITCHYARD_TEST_COLD") != "1" else None
    added = zygote.added_path(full_env, where) if zygote is not None and _warm_allowed(full_env) else None
    if zygote is None or added is None:
        if module in WARM_IMPORTS:
            global COLD_STARTS
            COLD_STARTS += 1
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=where,
                              env=full_env)
    return zygote.run(command, module, list(args), where, full_env, added, timeout)


def _warm_allowed(env: Mapping[str, str]) -> bool:
    """Whether every variable that differs from the zygote's may: PYTHONPATH is checked on its own."""
    base = Zygote.base_env()
    changed = {k for k in set(env) | set(base) if env.get(k) != base.get(k)} - {"PYTHONPATH"}
    return all(k in WARM_SAFE or k.startswith(WARM_SAFE_PREFIXES) for k in changed)


_ZYGOTE: Zygote | None = None
_STARTED: list[Zygote] = []  # every zygote this worker started, the dead ones too
# How many runs of a WARM_IMPORTS module started a new interpreter instead (the CPU ledger says
# which tests: an environment that differs, a cold=True run, SWITCHYARD_TEST_COLD).
COLD_STARTS = 0


def _zygote() -> Zygote | None:
    global _ZYGOTE
    if _ZYGOTE is None or not _ZYGOTE.alive():
        _ZYGOTE = Zygote()
        _STARTED.append(_ZYGOTE)
    return _ZYGOTE


def forked_cpu_s() -> float:
    """The CPU seconds of the processes forked for this worker so far, with what they waited for
    (a test reads it to tell that a run was forked)."""
    return sum(z.forked_cpu_s for z in _STARTED)


def unreaped_cpu_s() -> float:
    """The CPU seconds of the processes forked for this worker that its ``RUSAGE_CHILDREN`` does
    not hold yet: a zygote reaps them, and once this worker has reaped that zygote (a test that
    kills one), they are counted there, with the zygote's own."""
    return sum(z.forked_cpu_s for z in _STARTED if z.process.returncode is None)


class Zygote:
    """The warm process: started with this worker's environment (its base), serving forks."""

    _base: dict[str, str] | None = None

    @classmethod
    def base_env(cls) -> dict[str, str]:
        if cls._base is None:
            cls._base = dict(os.environ)
        return cls._base

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="zygote-")
        # The top-level modules it has imported, each with the file or package folder it came
        # from (None: a namespace package, a built-in or frozen module).
        self.imported: dict[str, str | None] | None = None
        self.forked_cpu_s = 0.0  # of the children it reaped, with what they waited for
        self.search: frozenset[str] = frozenset()  # its sys.path after the first entry, resolved
        atexit.register(shutil.rmtree, self.folder, True)
        self.path = os.path.join(self.folder, "socket")
        # OpenBLAS starts its thread pool when numpy is imported: one thread per core, unless told
        # otherwise. A fork leaves those threads behind, so the zygote imports with one; each child
        # then gets the test's own environment back.
        env = {**self.base_env(), "OPENBLAS_NUM_THREADS": "1",
               "SWITCHYARD_ZYGOTE_ENV": json.dumps(self.base_env())}
        code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import warm_start; "
                f"warm_start.serve({self.path!r}, {os.getpid()})")
        self.log = os.path.join(self.folder, "zygote.log")
        with open(self.log, "wb") as log:  # never the worker's stdout: pytest-xdist talks over it
            self.process = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=os.getcwd(),
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        # It would end by itself once this worker is gone (it watches its parent); reaped here, it
        # is not the "ResourceWarning: subprocess N is still running" the worker's exit printed.
        atexit.register(self.stop)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the test zygote did not start (exit {self.process.poll()}): "
                                   f"{Path(self.log).read_text()[-2000:]}")
            time.sleep(0.02)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()

    def alive(self) -> bool:
        return self.process.poll() is None

    def added_path(self, env: Mapping[str, str], cwd: str) -> list[str] | None:
        """The folders a test's PYTHONPATH puts before the zygote's own, as the interpreter would
        put them on ``sys.path`` (an empty entry is the directory, a relative one under it); None
        where it changes more than that, or where one of them holds a module the zygote has
        imported (a fake torch): a new interpreter would import that one, a fork never could."""
        given = env.get("PYTHONPATH", "").split(os.pathsep) if env.get("PYTHONPATH") else []
        base = self.base_env().get("PYTHONPATH")
        own = base.split(os.pathsep) if base else []
        if given[len(given) - len(own):] != own:
            return None
        added = [os.path.join(cwd, p) if p else cwd for p in given[:len(given) - len(own)]]
        if self.imported is None:
            found = json.loads(Path(self.folder, "imported.json").read_text())
            self.imported, self.search = found["modules"], frozenset(found["path"])
        if any(self.shadows(folder, self.imported, cwd, self.search) for folder in added):
            return None
        return added

    @staticmethod
    def shadows(folder: str, imported: Mapping[str, str | None], cwd: str,
                search: Collection[str] = ()) -> bool:
        """Whether a new interpreter started in ``cwd`` with ``folder`` on its PYTHONPATH might
        import one of these modules from the folder instead. A module or regular package of that
        name does, unless ``cwd`` (first on ``python -m``'s path) holds the very module imported.
        A directory without ``__init__.py`` is a namespace portion, which loses to a regular
        module found anywhere on the path: it changes nothing where the imported module's folder
        is on the path (``search``: the zygote's ``sys.path``, or ``cwd``). So tests/ on
        PYTHONPATH (folders named orchestrator, jobs and sharding) and the project's folder (the
        docs build's ``site/``) keep a run warm."""
        try:
            entries = os.listdir(folder)
        except OSError:
            return False
        for entry in entries:
            name = entry.split(".")[0]
            if name not in imported:
                continue
            origin = imported[name]
            here = [os.path.join(cwd, name, "__init__.py"), os.path.join(cwd, f"{name}.py")]
            if origin is not None and any(os.path.realpath(p) == origin for p in here if os.path.exists(p)):
                continue
            path = os.path.join(folder, entry)
            portion = os.path.isdir(path) and not os.path.exists(os.path.join(path, "__init__.py"))
            package = origin is not None and os.path.basename(origin).startswith("__init__.")
            home = None if origin is None else os.path.dirname(os.path.dirname(origin) if package else origin)
            if portion and home is not None and (home in search or home == os.path.realpath(cwd)):
                continue
            return True
        return False

    def run(self, command: list[str], module: str, args: list[str], cwd: str, env: dict[str, str],
            path: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            request = json.dumps({"module": module, "args": args, "cwd": cwd, "env": env,
                                  "path": path}).encode()
            socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], [out_w, err_w])
        except OSError:  # the zygote is gone (killed, out of memory): nothing ran, so start it cold
            pass
        finally:
            os.close(out_w)
            os.close(err_w)
        replies = conn.makefile("r")
        try:
            pid = int(json.loads(replies.readline())["pid"])
        except (OSError, ValueError):  # no fork answered: nothing ran, so start it cold
            for fd in (out_r, err_r):
                os.close(fd)
            conn.close()
            self.process.kill()
            return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
        deadline = time.monotonic() + timeout
        try:
            out, err = _read_to_end((out_r, err_r), deadline)
            line = replies.readline()
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(command, timeout) from None
        finally:
            os.close(out_r)
            os.close(err_r)
        conn.close()
        if not line:
            raise RuntimeError(f"the test zygote stopped before reporting pid {pid}'s end")
        ended = json.loads(line)
        self.forked_cpu_s += float(ended["cpu_s"])
        code = os.waitstatus_to_exitcode(int(ended["status"]))
        return subprocess.CompletedProcess(command, code, _text(out), _text(err))


def _read_to_end(fds: Sequence[int], deadline: float) -> tuple[bytes, bytes]:
    """Both pipes to their end (every writer closed them: the process, and what it started)."""
    chunks: dict[int, list[bytes]] = {fd: [] for fd in fds}
    with selectors.DefaultSelector() as sel:
        for fd in fds:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired("", 0)
            for key, _ in sel.select(timeout=min(left, 1.0)):
                data = os.read(key.fd, 65536)
                if data:
                    chunks[key.fd].append(data)
                else:
                    sel.unregister(key.fd)
    first, second = (b"".join(chunks[fd]) for fd in fds)
    return first, second


def _text(data: bytes) -> str:
    """As ``subprocess.run(text=True)`` decodes: the locale's encoding, universal newlines."""
    import locale

    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


# -- the zygote's side ----------------------------------------------------------------------------


def serve(path: str, parent: int) -> None:
    """Import ``WARM_IMPORTS``, then fork one child per request until the worker ``parent`` is gone."""
    import importlib

    sys.path.pop(0)  # this folder: the children get their own sys.path[0], as `python -m` sets it
    for name in WARM_IMPORTS:
        importlib.import_module(name)
        # What it imported stays; the module itself goes, as in a new `python -m` (which runs it as
        # __main__, never under its name): runpy then runs a fresh copy, and warns of nothing.
        del sys.modules[name]
        package, _, leaf = name.rpartition(".")
        if package:
            delattr(sys.modules[package], leaf)
    from orchestrator.training import rank_process

    for name in rank_process.ALL_RANK_MODULES:  # what a local job's controller imports, kept
        importlib.import_module(name)
    base = json.loads(os.environ["SWITCHYARD_ZYGOTE_ENV"])
    os.environ.clear()
    os.environ.update(base)  # the worker's, exactly
    # What a folder on a test's PYTHONPATH must not hold (this module is dropped in each child).
    tops = sorted({name.split(".")[0] for name in sys.modules} - {__name__, "__main__"})
    files = {name: getattr(sys.modules.get(name), "__file__", None) for name in tops}
    imported = {name: os.path.realpath(file) if file else None for name, file in files.items()}
    search = [os.path.realpath(p) for p in sys.path[1:] if p]  # the children replace the first
    Path(os.path.dirname(path), "imported.json").write_text(json.dumps({"modules": imported,
                                                                       "path": search}))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)
    listener.listen(16)
    children: dict[int, socket.socket] = {}
    with selectors.DefaultSelector() as sel:
        sel.register(listener, selectors.EVENT_READ)
        while os.getppid() == parent:
            for _ in sel.select(timeout=0.02):
                conn, _ = listener.accept()
                try:
                    children[_fork_child(conn, listener, children)] = conn
                except OSError:  # the test went away mid-request: it reads no answer
                    conn.close()
            while children:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
                if pid == 0:
                    break
                ended = children.pop(pid, None)
                if ended is not None:  # its CPU, with what it waited for (the local job under it)
                    reply = {"status": status, "cpu_s": usage.ru_utime + usage.ru_stime}
                    with contextlib.suppress(OSError):
                        ended.sendall(json.dumps(reply).encode() + b"\n")
                    ended.close()


def _receive(conn: socket.socket) -> tuple[dict[str, object], list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 8, 2)
    while len(head) < 8:
        more = conn.recv(8 - len(head))
        if not more:
            raise OSError("the test closed its request")
        head += more
    size = int.from_bytes(head, "big")
    body = b""
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise OSError("the test closed its request")
        body += more
    return json.loads(body), list(fds)


def _fork_child(conn: socket.socket, listener: socket.socket, children: dict[int, socket.socket]) -> int:
    request, fds = _receive(conn)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in children.values():
            other.close()
        conn.close()
        _become(request, fds)  # never returns
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return pid


def _become(request: dict[str, object], fds: list[int]) -> None:
    """In the child: the test's pipes on fds 1 and 2, its environment, directory and command line;
    then the module as ``python -m`` runs it, and the interpreter's exit."""
    import importlib.util
    import random
    import runpy

    from orchestrator.quick_exit import exit_as_interpreter

    def run() -> None:
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(dict(request["env"]))  # type: ignore[call-overload]
        cwd = str(request["cwd"])
        os.chdir(cwd)
        sys.path[0] = cwd  # what `python -m` puts first, then the test's PYTHONPATH before the zygote's
        sys.path[1:1] = list(request["path"])  # type: ignore[call-overload]
        importlib.invalidate_caches()
        sys.modules.pop(__name__, None)  # the zygote's own module is no module of the job's
        random.seed()  # a new interpreter's seeds, not the zygote's
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        module = str(request["module"])
        spec_origin = str(importlib.util.find_spec(module).origin)  # type: ignore[union-attr]
        sys.argv = [spec_origin, *map(str, request["args"])]  # type: ignore[call-overload]
        runpy.run_module(module, run_name="__main__", alter_sys=True)

    exit_as_interpreter(run, join_threads=True)  # non-daemon threads joined, as at exit
