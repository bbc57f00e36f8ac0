"""What the user types at an entry point, read in one place per kind of value: a wrong one is one
``error:`` line naming it (exit 2), never a traceback.

- Hydra overrides (``python -m jobs.train``, ``jobs.prepare``, ``switchyard run``): ``hydra_app``
  runs the app, refusing control characters and overrides Hydra cannot parse before Hydra echoes
  them, and turning what Hydra raises before the task starts (a key no config has, a group option
  that does not exist, a run directory it cannot create) into one line. Hydra itself prints these
  as several lines and a hint about ``HYDRA_FULL_ERROR``, with exit 1. It also spares Hydra's
  mode probe where only Switchyard's own configs can take part (``mode_probe_needed``).
- Paths given as command-line arguments (``switchyard verify``, ``plot``, ``--registry``,
  ``--store``): ``existing_dir``, ``existing_file`` and ``new_file`` check them before anything is
  read or created, naming the argument, the path and the reason (a name too long, a component that
  is a file, a FIFO where a directory is expected).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import os
import stat
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from orchestrator.terminal import one_line, refuse_control

_FULL_ERROR = "HYDRA_FULL_ERROR"
_owned: list[bool] = [False]  # hydra_app set HYDRA_FULL_ERROR, and task_started has not unset it
KEY_MAX = 255  # longer than any file name: no config key or group is named so
# Where Switchyard's apps find their configs, as Hydra's search path lists them (provider, path):
# Hydra's own, Switchyard's conf package, and the structured configs both register.
OWN_SEARCH_PATH = frozenset({("hydra", "pkg://hydra.conf"), ("main", "pkg://conf"),
                             ("schema", "structured://")})
MODE_KEYS = ("hydra.mode", "hydra.searchpath")  # overrides that set the mode, or add configs that may
_Task = TypeVar("_Task", bound=Callable[..., Any])


class PathError(ValueError):
    """A path argument cannot be what the command needs; the message names it and why."""


class RefusedBeforeStart(BaseException):
    """Raised by a Hydra callback's ``on_run_start`` (``launch.ownership.RunDirCheck``) to refuse
    the run before Hydra writes anything into its directory; ``hydra_app`` prints it as one
    ``error:`` line. A BaseException because Hydra turns a callback's Exception into a warning and
    goes on."""


# ------------------------------------------------------------------------------------------------
# Hydra apps


def refuse_argv(argv: Sequence[str]) -> str | None:
    """Why the command line cannot reach Hydra, or None: an argument with a control character
    (Hydra would echo it raw), or an override its grammar rejects (``optim.lr=${``)."""
    if refused := refuse_control(argv):
        return refused
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for override in _overrides(argv):
        key = override.partition("=")[0]
        if len(key) > KEY_MAX:  # Hydra would look it up as a file name: ENAMETOOLONG, a traceback
            return (f"the override {shown(override)} has a key of {len(key)} characters: no config "
                    f"has one that long (check the override)")
        try:
            parser.parse_override(override)
        except HydraException as e:
            reason = describe(e).removeprefix(f"Error parsing override {override!r}; ")
            return f"the override {shown(override)} cannot be parsed: {reason}"
    return None


def _overrides(argv: Sequence[str]) -> list[str]:
    """The overrides of a Hydra command line, as ``@hydra.main`` finds them (``--cfg job``,
    ``-m``, ``--config-name X`` are Hydra's own flags); none when Hydra would refuse the flags
    itself (it prints its usage)."""
    from orchestrator import library_versions
    if not library_versions.hooks_allowed("hydra-core"):
        return []  # Hydra refuses what it cannot parse itself, with its own message
    from hydra._internal.utils import get_args_parser

    quiet = io.StringIO()  # its usage or --version: Hydra prints them when it parses the same line
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            return list(get_args_parser().parse_args(list(argv[1:])).overrides)
    except SystemExit:
        return []


def describe(error: BaseException) -> str:
    """One line for an error Hydra or OmegaConf raised about the user's config or overrides."""
    from hydra.errors import MissingConfigException

    if isinstance(error, OSError) and not isinstance(error, MissingConfigException):
        where = f" {error.filename!r}" if error.filename else ""
        return (f"cannot create the run directory{where}: {error.strerror or error} (try "
                f"hydra.run.dir=<a directory you can write>, or hydra.sweep.dir= with -m)")
    cause = str(error.__cause__) if error.__cause__ else ""
    parts = [str(error), *([cause] if cause and cause not in str(error) else [])]  # said once
    text = ""
    for line in (line.strip() for part in parts for line in part.splitlines()):
        if line:
            text += ("" if not text else " " if text.endswith((".", ":")) else "; ") + line
    return one_line(text)


def hydra_app(main: Callable[[], Any], argv: Sequence[str], prefix: str = "") -> None:
    """Run the ``@hydra.main`` function ``main`` (its task decorated with ``hydra_task``) for the
    command line ``argv``. Hydra's own errors before the task starts are one ``{prefix}error:``
    line and exit 2; once the task runs, its errors are its own. A user who set HYDRA_FULL_ERROR
    gets Hydra's full report, as asked."""
    if refused := refuse_argv(argv):
        _exit(prefix, refused)
    try:
        with _mode_from_the_command_line():
            _run_reporting(main, prefix)
    except RefusedBeforeStart as e:
        task_started()
        _exit(prefix, one_line(str(e)))


def _run_reporting(main: Callable[[], Any], prefix: str) -> None:
    if os.environ.get(_FULL_ERROR):
        main()
        return
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    os.environ[_FULL_ERROR] = "1"  # Hydra raises instead of printing; hydra_task unsets it
    _owned[0] = True
    try:
        main()
    except (HydraException, OmegaConfBaseException, OSError) as e:
        if not _owned[0]:
            raise  # raised after the task started (Hydra printed it then), or by the task
        task_started()
        _exit(prefix, describe(e))
    finally:
        task_started()


def mode_probe_needed(search_path: Iterable[tuple[str, str]], overrides: Sequence[str]) -> bool:
    """Whether Hydra must compose the config to learn its mode (``hydra.mode``: a config may make a
    sweep its default). Not when only Switchyard's configs take part (``OWN_SEARCH_PATH``: no
    ``--config-dir``, no other search path plugin) and no override names the mode or adds to the
    search path: none of Switchyard's configs sets either (``tests/test_hydra_mode.py``), so the mode
    is the command line's, ``-m`` or not."""
    if not set(search_path) <= OWN_SEARCH_PATH:
        return True
    return any(o.lstrip("+~").partition("=")[0].strip().startswith(MODE_KEYS) for o in overrides)


@contextlib.contextmanager
def _mode_from_the_command_line() -> Iterator[None]:
    """Hydra's ``get_mode`` composes the whole config, then ``run`` composes it again: the probe
    was 0.13 s of a submitting ``jobs.train``'s 0.45 s of CPU after its imports (and each rank under
    the user's own srun paid it too). Where ``mode_probe_needed`` says no, it answers as the probe
    would have on these configs: None, "the command line decides"."""
    from orchestrator import library_versions
    if not library_versions.hooks_allowed("hydra-core"):
        yield  # Hydra's own probe
        return
    from hydra._internal.hydra import Hydra

    probe = getattr(Hydra, "get_mode", None)  # Hydra's own, not a public API: checked, not assumed
    if probe is None:
        yield
        return

    def get_mode(self: Hydra, config_name: str | None, overrides: list[str]) -> Any:
        try:
            search_path = [(e.provider, e.path) for e in self.config_loader.get_search_path().get_path()]
        except AttributeError:  # a Hydra that keeps its search path elsewhere: probe, as it would
            return probe(self, config_name, overrides)
        if mode_probe_needed(search_path, overrides):
            return probe(self, config_name, overrides)
        return None

    Hydra.get_mode = get_mode  # type: ignore[method-assign]
    try:
        yield
    finally:
        Hydra.get_mode = probe  # type: ignore[method-assign]


def task_started() -> None:
    """The app's task (or the sweep launcher) runs now: errors are its own again, and the jobs it
    starts do not inherit ``hydra_app``'s HYDRA_FULL_ERROR."""
    if _owned[0]:
        os.environ.pop(_FULL_ERROR, None)
        _owned[0] = False


def hydra_task(task: _Task) -> _Task:
    """Under ``@hydra.main``: marks the start of the task for ``hydra_app``."""
    @functools.wraps(task)
    def started(*args: Any, **kwargs: Any) -> Any:
        task_started()
        return task(*args, **kwargs)
    return started  # type: ignore[return-value]


def _exit(prefix: str, message: str) -> NoReturn:
    print(f"{prefix}error: {message}", file=sys.stderr)
    sys.exit(2)


# ------------------------------------------------------------------------------------------------
# Paths


def _stat(option: str, text: str) -> os.stat_result | None:
    """``os.stat`` of the path; None when it does not exist; PathError when it cannot be looked
    up (a name too long, a component that is a file, a loop of links, no permission)."""
    if not text or "\x00" in text:
        raise PathError(f"{_named(option, text)} is not a path")
    try:
        return os.stat(Path(text).expanduser())
    except FileNotFoundError:
        return None
    except OSError as e:
        reasons = {errno.ENOTDIR: "a component of it is a file, not a directory",
                   errno.ENAMETOOLONG: "the name is too long for the file system"}
        why = reasons.get(e.errno or 0) or e.strerror or str(e)
        raise PathError(f"{_named(option, text)} cannot be used: {why}") from e


def existing_dir(option: str, text: str, what: str = "a directory") -> Path:
    """The directory ``text`` names, which must exist; PathError naming ``option`` otherwise."""
    return _existing(option, text, what, stat.S_ISDIR)


def existing_file(option: str, text: str, what: str = "a file") -> Path:
    """The regular file ``text`` names, which must exist; PathError naming ``option`` otherwise."""
    return _existing(option, text, what, stat.S_ISREG)


def _existing(option: str, text: str, what: str, is_kind: Callable[[int], bool]) -> Path:
    st = _stat(option, text)
    if st is None:
        raise PathError(f"{_named(option, text)} does not exist (give {what})")
    if not is_kind(st.st_mode):
        raise PathError(f"{_named(option, text)} is {_kind(st)}, not {what}")
    return Path(text).expanduser().absolute()


def new_file(option: str, text: str) -> Path:
    """A file path to write: not a directory or a FIFO, and its parent an existing directory (or
    one that can be made: no component of it is a file)."""
    st = _stat(option, text)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise PathError(f"{_named(option, text)} is {_kind(st)}: give a file name to write")
    path = Path(text).expanduser().absolute()
    parent = path.parent
    while True:  # the nearest existing ancestor must be a directory
        parent_st = _stat(option, str(parent))
        if parent_st is not None:
            if not stat.S_ISDIR(parent_st.st_mode):
                raise PathError(f"{_named(option, text)} cannot be written: {shown(str(parent))} is "
                                f"{_kind(parent_st)}, not a directory")
            return path
        parent = parent.parent


def _named(option: str, text: str) -> str:
    return f"{option} {shown(text)}" if option else shown(text)


def _kind(st: os.stat_result) -> str:
    mode = st.st_mode
    return ("a directory" if stat.S_ISDIR(mode) else "a file" if stat.S_ISREG(mode)
            else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")


def shown(text: str, limit: int = 200) -> str:
    """A value as typed, quoted and escaped for an error line, cut to ``limit`` characters (a
    10,000-character one stays readable)."""
    shown = one_line(repr(text[:limit]))
    return shown if len(text) <= limit else f"{shown}... ({len(text)} characters)"


def checked(check: Callable[[str, str], Path], option: str = "") -> Callable[[str], Path]:
    """An argparse ``type=``: ``check(option, value)``, a PathError its one-line usage error
    (argparse names the argument)."""
    import argparse

    def parse(text: str) -> Path:
        try:
            return check(option, text)
        except PathError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    parse.__name__ = "path"
    return parse
