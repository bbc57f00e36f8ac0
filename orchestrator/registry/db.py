"""The registry: one SQLite file recording every sweep, its jobs and every attempt at each job.

Vocabulary: a *sweep* is one ``-m`` invocation; a *job* is one point of it (Hydra's job number,
its overrides, its run directory); an *attempt* is one submission of a job (a SLURM array task or
plain job, or a local process). ``switchyard resubmit`` adds attempts to existing jobs.

Who writes, and why it cannot lose an update:

- The submitting process (the launcher, ``switchyard resubmit``) and the CLI (reconciliation,
  ``cancel``) write. Array tasks never open the database: a task writes only its own small status
  file next to its run directory (:class:`TaskStatus`, replaced atomically), so a hundred tasks
  ending at the same moment write a hundred different files. Nodes need no access to the database
  at all: it can sit on the login node's local disk, where SQLite locking works (on NFS it does not).
- Writers that do meet (two terminals running ``switchyard status``, a blocking launcher and a
  ``cancel``) are serialised by SQLite: WAL (readers never block the writer), ``BEGIN IMMEDIATE``
  (a writer holds the write lock *before* it reads what it will change, so read-modify-write
  cannot interleave) and a long busy timeout (a writer waits its turn instead of raising
  "database is locked"). An ended attempt cannot be moved back (:func:`accepts`), so a reconciler
  that read SLURM earlier cannot overwrite the end another one recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from orchestrator.registry.states import (
    FINAL_STATES,
    RECHECK_REQUEUABLE_S,
    REQUEUABLE_STATES,
    RETRY_STATES,
    SUBMIT_FAILED,
    SUBMITTED,
    SUBMITTING,
    TERMINAL_STATES,
    accepts,
)

REGISTRY_ENV = "SWITCHYARD_REGISTRY"
DEFAULT_PATH = Path("~/.local/share/switchyard/registry.db")
BUSY_TIMEOUT_S = 120.0  # a writer waits this long for the lock; transactions here take milliseconds

_SWEEPS = """
CREATE TABLE sweeps (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at  REAL NOT NULL,
    app         TEXT NOT NULL,      -- hydra.job.name
    command     TEXT NOT NULL,      -- the sweep's overrides, as typed
    sweep_dir   TEXT NOT NULL,
    executor    TEXT NOT NULL,      -- slurm | local
    entry_path  TEXT NOT NULL       -- pickled task function + Hydra context the tasks load
)"""
_JOBS = """
CREATE TABLE jobs (
    sweep_id    INTEGER NOT NULL REFERENCES sweeps(id),
    num         INTEGER NOT NULL,   -- hydra.job.num
    overrides   TEXT NOT NULL,      -- JSON list
    run_dir     TEXT NOT NULL,
    resources   TEXT NOT NULL,      -- JSON: what the job asks of the executor (the array key)
    total_steps INTEGER,            -- optim.max_steps when the config has it (progress)
    PRIMARY KEY (sweep_id, num)
)"""
_ATTEMPTS = """
CREATE TABLE attempts (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    sweep_id     INTEGER NOT NULL,
    num          INTEGER NOT NULL,
    attempt      INTEGER NOT NULL,  -- 1 at submission, +1 per resubmit
    slurm_id     TEXT,              -- ARRAYID_INDEX, a plain job id, or a local pid
    array_id     TEXT,
    array_index  INTEGER,
    state        TEXT NOT NULL,
    requeues     INTEGER NOT NULL DEFAULT 0,
    submitted_at REAL NOT NULL,
    started_at   REAL,
    ended_at     REAL,
    exit_code    INTEGER,
    node         TEXT,
    error        TEXT,
    log_dir      TEXT,
    updated_at   REAL NOT NULL,
    UNIQUE (sweep_id, num, attempt),
    FOREIGN KEY (sweep_id, num) REFERENCES jobs(sweep_id, num)
)"""
_ATTEMPTS_BY_STATE = "CREATE INDEX attempts_by_state ON attempts(state)"
_RESULTS = """
CREATE TABLE results (
    attempt_id  INTEGER PRIMARY KEY REFERENCES attempts(id),
    step        INTEGER,            -- the last training line of metrics.jsonl
    loss        REAL,
    peak_bytes  INTEGER,            -- the memory section's highest peak (GPU used, else rank RSS)
    flags       TEXT NOT NULL,      -- JSON list: the memory section's flags
    memory      TEXT                -- JSON: summary.json's memory section, or the telemetry summarised
)"""
_DIGESTS = """
CREATE TABLE digests (
    attempt_id  INTEGER PRIMARY KEY REFERENCES attempts(id),
    state       TEXT NOT NULL       -- JSON: written by older versions only (telemetry folded so far)
)"""
_EXCLUSIONS = """
CREATE TABLE {if_missing} exclusions (
    attempt_id  INTEGER PRIMARY KEY REFERENCES attempts(id),
    nodes       TEXT NOT NULL       -- JSON list of {{node, why, attempt}}: what this attempt was kept off
)"""
_PROVENANCE = """
CREATE TABLE provenance (
    sweep_id    INTEGER NOT NULL,
    num         INTEGER NOT NULL,
    record      TEXT NOT NULL,      -- JSON: what the job's RUN/provenance.json says it runs
    PRIMARY KEY (sweep_id, num)
)"""
# A hyperparameter search (orchestrator/search) is a sweep whose jobs are added as its trials are
# asked: one row here per search, one per trial tying Optuna's trial to the sweep's job.
_SEARCHES = """
CREATE TABLE searches (
    sweep_id    INTEGER PRIMARY KEY REFERENCES sweeps(id),
    study_path  TEXT NOT NULL,      -- Optuna's journal file, in the sweep directory
    settings    TEXT NOT NULL       -- JSON: the search's settings, base overrides and trial entry
)"""
_TRIALS = """
CREATE TABLE trials (
    sweep_id    INTEGER NOT NULL,
    num         INTEGER NOT NULL,   -- the sweep's job number, which is Optuna's trial number
    params      TEXT NOT NULL,      -- JSON {key: value}: the trial's overrides of the search space
    state       TEXT NOT NULL,      -- RUNNING | COMPLETED | PRUNED | FAILED
    step        INTEGER,            -- the last step reported (pruned: where it was pruned)
    value       REAL,               -- the objective (pruned: the last intermediate value)
    error       TEXT,               -- a failed trial's cause
    updated_at  REAL NOT NULL,
    PRIMARY KEY (sweep_id, num)
)"""


def _statements(*sql: str) -> Callable[[sqlite3.Connection], None]:
    """A migration step that runs these statements."""
    def step(db: sqlite3.Connection) -> None:
        for statement in sql:
            db.execute(statement)
    return step


# The schema's history, one step per version: a file at version N gets the steps after N, in order,
# in one transaction (a new file is at version 0). A change to the schema is a new step at the
# end, never an edit of one here: files at every version before it exist.
MIGRATIONS: tuple[tuple[int, Callable[[sqlite3.Connection], None]], ...] = (
    (1, _statements(_SWEEPS, _JOBS, _ATTEMPTS, _ATTEMPTS_BY_STATE)),
    (2, _statements(_RESULTS)),  # what an ended attempt left, read once
    (3, _statements(_DIGESTS)),  # a running attempt's telemetry folded so far
    (4, _statements(_EXCLUSIONS.format(if_missing=""))),  # the nodes a retry was kept off
    (5, _statements(_PROVENANCE)),  # what each job runs
    # Version 5 as first released made new files without the exclusions table (a rewrite of this
    # file dropped it); a file that came from version 4 has it.
    (6, _statements(_EXCLUSIONS.format(if_missing="IF NOT EXISTS"))),
    (7, _statements(_SEARCHES, _TRIALS)),  # hyperparameter searches and their trials
)
SCHEMA_VERSION = MIGRATIONS[-1][0]


def _version_of_tables(tables: set[str]) -> int | None:
    """The registry version whose file holds ``tables`` (each step above adds one; version 6 is 5
    with the exclusions table sure to be there), or None when they are not a registry's."""
    if not {"sweeps", "jobs", "attempts"} <= tables or tables - {
            "sweeps", "jobs", "attempts", "results", "digests", "exclusions", "provenance", "searches",
            "trials"}:
        return None
    if {"searches", "trials"} <= tables:
        return 7
    if "provenance" in tables:
        return 6 if "exclusions" in tables else 5
    return 4 if "exclusions" in tables else 3 if "digests" in tables else 2 if "results" in tables else 1


class RegistryError(RuntimeError):
    """The registry cannot answer: unknown sweep or job, or an unreadable database."""


def damaged(path: Path, error: sqlite3.DatabaseError) -> RegistryError:
    """The one-line error for a registry SQLite cannot read, whenever it is noticed: at open, or
    at the first query that reaches a damaged page (SQLite checks pages as it reads them)."""
    return RegistryError(
        f"the sweep registry {path} cannot be read ({error}): move it aside with `mv {path} "
        f"{path}.damaged`, and a new, empty registry is made at the next sweep. The sweeps' own files "
        f"(configs, logs, results under each sweep directory) are not in it and stay as they are; "
        f"or point {REGISTRY_ENV} at another file")


def default_path() -> Path:
    """``$SWITCHYARD_REGISTRY``, else ``~/.local/share/switchyard/registry.db``."""
    return Path(os.environ.get(REGISTRY_ENV) or DEFAULT_PATH).expanduser()

# ------------------------------------------------------------------------------------------------
# Rows


@dataclass(frozen=True)
class Sweep:
    id: int
    created_at: float
    app: str
    command: str
    sweep_dir: str
    executor: str
    entry_path: str


# A single job (a jobs.train run, a switchyard run command, a submitted function) is recorded as a
# sweep of one job, number SINGLE_NUM, with no saved sweep entry to resubmit it from.
SINGLE_NUM = 0
SINGLE_ENTRY = ""


def is_single(entry_path: str) -> bool:
    return entry_path == SINGLE_ENTRY


@dataclass(frozen=True)
class Job:
    sweep_id: int
    num: int
    overrides: list[str]
    run_dir: str
    resources: dict[str, Any]
    total_steps: int | None

    @property
    def ref(self) -> str:
        """How a user names it on the command line: ``SWEEP/NUM``."""
        return f"{self.sweep_id}/{self.num}"


@dataclass(frozen=True)
class Attempt:
    id: int
    sweep_id: int
    num: int
    attempt: int
    slurm_id: str | None
    array_id: str | None
    array_index: int | None
    state: str
    requeues: int
    submitted_at: float
    started_at: float | None
    ended_at: float | None
    exit_code: int | None
    node: str | None
    error: str | None
    log_dir: str | None
    updated_at: float


# The attempts table's columns in Attempt's field order: rows build Attempts by position.
_ATTEMPT_COLUMNS = ", ".join(f"a.{f.name}" for f in fields(Attempt))


@dataclass(frozen=True)
class Trial:
    """One trial of a search: its job (``sweep_id``/``num``) and what Optuna was told of it."""

    sweep_id: int
    num: int
    params: dict[str, Any]
    state: str
    step: int | None
    value: float | None
    error: str | None
    updated_at: float


@dataclass(frozen=True)
class Submitted:
    """What sbatch (or the local executor) answered for one claimed attempt."""

    attempt_id: int
    slurm_id: str
    array_id: str | None
    array_index: int | None
    log_dir: str


@dataclass(frozen=True)
class Observation:
    """What reconciliation learned about one attempt; None fields leave the stored value."""

    attempt_id: int
    state: str
    requeues: int = 0
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    node: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Result:
    """What an ended attempt left in its run directory, read once and kept in the registry (the
    files of an ended attempt do not change; telemetry without a summary.json costs about 1 ms
    per minute sampled to summarise, on every `status`, forever, if it were not kept)."""

    step: int | None  # the last training line of metrics.jsonl
    loss: float | None
    peak_bytes: int | None  # what the PEAK MEM column shows
    flags: list[str]  # the memory section's warnings
    memory_json: str | None  # the whole section, decoded only where it is shown whole

    @property
    def memory(self) -> dict[str, Any] | None:
        value = json.loads(self.memory_json) if self.memory_json else None
        return value if isinstance(value, dict) else None


@contextlib.contextmanager
def damage_reported(path: Path) -> Iterator[None]:
    """A damaged page met by any query inside: ``damaged``'s one line instead of SQLite's raw error."""
    try:
        yield
    except sqlite3.OperationalError:
        raise  # locked, no permission, an I/O error: not damage, and said as SQLite says it
    except sqlite3.DatabaseError as e:
        raise damaged(path, e) from e

# ------------------------------------------------------------------------------------------------
# The database


class Registry:
    """One connection to the registry file; create one per process (or thread)."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path).expanduser() if path else default_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a component that is a file, a name too long, no permission
            raise RegistryError(f"cannot open the sweep registry {self.path}: {e.strerror} ({e.filename}; "
                                f"set {REGISTRY_ENV} to use another file)") from e
        try:
            # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE in _write).
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            self._db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            self._init_schema()
        except RegistryError:
            self._db.close()
            raise
        except sqlite3.OperationalError as e:  # not a damaged file: no permission, a directory...
            raise RegistryError(f"cannot open the sweep registry {self.path}: {e} (set "
                                f"{REGISTRY_ENV} to use another file)") from e
        except sqlite3.DatabaseError as e:
            raise damaged(self.path, e) from e

    def _init_schema(self) -> None:
        self._version()  # a newer file is refused before anything in it is changed
        self._use_wal()
        self._db.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: durable across app crashes
        if self._version() == SCHEMA_VERSION:
            return
        with self._write() as db:
            version = self._version()  # again, under the lock: another process may have migrated it
            for to_version, step in MIGRATIONS:
                if to_version > version:
                    step(db)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _version(self) -> int:
        """The file's schema version; one written by a newer Switchyard is refused, not relabelled
        (its tables may mean what this version cannot know), and so is one whose stamp says it is
        new or is no version at all while it holds tables (``_unstamped``)."""
        version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise RegistryError(
                f"the sweep registry {self.path} was written by a newer Switchyard (registry version "
                f"{version}; this one reads versions up to {SCHEMA_VERSION}): run the newer Switchyard, "
                f"or set {REGISTRY_ENV} to another file for this one")
        if version <= 0:
            self._refuse_unstamped(version)
        return version

    def _refuse_unstamped(self, version: int) -> None:
        """A new file is at version 0 and empty. One at 0 (or below) that holds tables had its stamp
        reset (a tool that rewrote the file, a copy made table by table): migrating it from 0 failed
        on "table sweeps already exists". Its tables say which version it is: every step of the
        schema's history adds a table, so the fix restores the stamp, and nothing is guessed here."""
        tables = {name for (name,) in self._db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")}
        if version == 0 and not tables:
            return
        if version == 0 and int(self._db.execute("PRAGMA user_version").fetchone()[0]) > 0:
            return  # another process's migration committed between the two reads: a new file, made
        own = _version_of_tables(tables)
        stamp = f"its version stamp (PRAGMA user_version) is {version}"
        if own is None:
            raise RegistryError(
                f"the sweep registry {self.path} is not one: {stamp} and it holds tables no registry has "
                f"({', '.join(sorted(tables)) or 'none'}); set {REGISTRY_ENV} to another file")
        fix = f"sqlite3.connect('{self.path}').execute('PRAGMA user_version = {own}')"
        raise RegistryError(
            f"the sweep registry {self.path} is damaged: {stamp}, but its tables are those of registry "
            f"version {own} (something reset the stamp); restore it with python -c \"import sqlite3; "
            f"{fix}\", or set {REGISTRY_ENV} to another file")

    def _use_wal(self) -> None:
        """WAL is a property of the file, set once; changing it needs a moment alone with the file.
        When many processes open a new registry at once, two of them may both hold a read lock and
        ask for that moment: SQLite then answers one "database is locked" at once, without its busy
        handler (waiting would deadlock), so that one lets go and tries again, within the timeout."""
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while self._db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
            try:
                self._db.execute("PRAGMA journal_mode = WAL")
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(random.uniform(0.005, 0.05))  # apart from the others that lost the race

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction holding the write lock from its first statement."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # -- writes --------------------------------------------------------------------------------

    def create_sweep(self, app: str, command: str, sweep_dir: str, executor: str,
                     entry_path: str) -> int:
        with self._write() as db:
            cur = db.execute("INSERT INTO sweeps (created_at, app, command, sweep_dir, executor, "
                             "entry_path) VALUES (?, ?, ?, ?, ?, ?)",
                             (time.time(), app, command, sweep_dir, executor, entry_path))
            return int(cur.lastrowid or 0)

    def add_jobs(self, jobs: Iterable[Job]) -> None:
        with self._write() as db:
            db.executemany(
                "INSERT OR REPLACE INTO jobs (sweep_id, num, overrides, run_dir, resources, total_steps) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [(j.sweep_id, j.num, json.dumps(j.overrides), j.run_dir,
                  json.dumps(j.resources, sort_keys=True), j.total_steps) for j in jobs])

    def claim(self, sweep_id: int, nums: Iterable[int]) -> dict[int, int]:
        """New SUBMITTING attempts for these jobs, before sbatch runs: ``{num: attempt_id}``.

        Claiming first means a submitter that dies after sbatch still left a row to find.
        """
        with self._write() as db:
            return {num: self._insert_attempt(db, sweep_id, num) for num in nums}

    def claim_retries(self, sweep_id: int, states: frozenset[str] = RETRY_STATES) -> dict[int, int]:
        """Claim a new attempt for every job whose latest attempt ended in ``states``.

        Read and insert happen under one write lock: two ``resubmit`` commands racing each other
        resubmit each job once (the second sees the first one's SUBMITTING attempt).
        """
        with self._write() as db:
            latest = db.execute(_LATEST_ATTEMPTS, (sweep_id,)).fetchall()
            return {row["num"]: self._insert_attempt(db, sweep_id, row["num"])
                    for row in latest if row["state"] in states}

    @staticmethod
    def _insert_attempt(db: sqlite3.Connection, sweep_id: int, num: int) -> int:
        now = time.time()
        cur = db.execute(
            "INSERT INTO attempts (sweep_id, num, attempt, state, submitted_at, updated_at) "
            "VALUES (?, ?, (SELECT COALESCE(MAX(attempt), 0) + 1 FROM attempts "
            "WHERE sweep_id = ? AND num = ?), ?, ?, ?)",
            (sweep_id, num, sweep_id, num, SUBMITTING, now, now))
        return int(cur.lastrowid or 0)

    def confirm(self, submitted: Iterable[Submitted]) -> None:
        now = time.time()
        with self._write() as db:
            db.executemany(
                "UPDATE attempts SET slurm_id = ?, array_id = ?, array_index = ?, log_dir = ?, "
                "state = ?, submitted_at = ?, updated_at = ? WHERE id = ? AND state = ?",
                [(s.slurm_id, s.array_id, s.array_index, s.log_dir, SUBMITTED, now, now,
                  s.attempt_id, SUBMITTING) for s in submitted])

    def fail_claims(self, attempt_ids: Iterable[int], error: str) -> None:
        now = time.time()
        with self._write() as db:
            db.executemany("UPDATE attempts SET state = ?, error = ?, ended_at = ?, updated_at = ? "
                           "WHERE id = ? AND state = ?",
                           [(SUBMIT_FAILED, error[-2000:], now, now, i, SUBMITTING) for i in attempt_ids])

    def observe(self, observations: Iterable[Observation]) -> int:
        """Apply what reconciliation saw, in one transaction; returns how many attempts changed.

        Each row is re-read under the write lock and changed only if :func:`accepts` allows it.
        """
        changed = 0
        with self._write() as db:
            for o in observations:
                row = db.execute("SELECT * FROM attempts WHERE id = ?", (o.attempt_id,)).fetchone()
                if row is None:
                    continue
                if not accepts(row["state"], row["requeues"], o.state, max(o.requeues, row["requeues"])):
                    continue
                merged = _merge(dict(row), o)
                if merged == dict(row):
                    continue
                merged["updated_at"] = time.time()
                db.execute("UPDATE attempts SET state = :state, requeues = :requeues, "
                           "started_at = :started_at, ended_at = :ended_at, exit_code = :exit_code, "
                           "node = :node, error = :error, updated_at = :updated_at WHERE id = :id",
                           merged)
                db.execute("DELETE FROM results WHERE attempt_id = ?", (o.attempt_id,))  # a new end
                changed += 1
        return changed

    # -- reads ---------------------------------------------------------------------------------

    def sweeps(self) -> list[Sweep]:
        return [Sweep(**dict(r)) for r in self._db.execute("SELECT * FROM sweeps ORDER BY id")]

    def sweep(self, sweep_id: int) -> Sweep:
        row = self._db.execute("SELECT * FROM sweeps WHERE id = ?", (sweep_id,)).fetchone()
        if row is None:
            known = [s.id for s in self.sweeps()][-10:]
            raise RegistryError(f"no sweep {sweep_id} in {self.path} (latest: {known or 'none'}; "
                                f"`switchyard status` lists them)")
        return Sweep(**dict(row))

    def jobs(self, sweep_id: int, resources: bool = True) -> list[Job]:
        """The sweep's jobs in order; ``resources=False`` leaves each job's resources unread
        (``{}``): views that never show them skip decoding 10,000 JSON objects."""
        rows = self._db.execute(f"SELECT sweep_id, num, overrides, run_dir, "
                                f"{'resources' if resources else _NO_RESOURCES}, total_steps "
                                f"FROM jobs WHERE sweep_id = ? ORDER BY num", (sweep_id,))
        return [_job(r) for r in rows]

    def job(self, sweep_id: int, num: int) -> Job:
        row = self._db.execute("SELECT * FROM jobs WHERE sweep_id = ? AND num = ?",
                               (sweep_id, num)).fetchone()
        if row is None:
            raise RegistryError(f"sweep {sweep_id} has no job {num} "
                                f"(`switchyard status {sweep_id}` lists its jobs)")
        return _job(row)

    def attempts(self, sweep_id: int, num: int | None = None) -> list[Attempt]:
        query, args = f"SELECT {_ATTEMPT_COLUMNS} FROM attempts a WHERE sweep_id = ?", [sweep_id]
        if num is not None:
            query, args = query + " AND num = ?", [*args, num]
        return [Attempt(*r) for r in self._db.execute(query + " ORDER BY num, attempt", args)]

    def latest_attempts(self, sweep_id: int) -> dict[int, Attempt]:
        rows = self._db.execute(_LATEST_ATTEMPTS, (sweep_id,))
        return {r[2]: Attempt(*r) for r in rows}  # r[2]: num

    def count_jobs(self, sweep_id: int) -> int:
        row = self._db.execute("SELECT COUNT(*) FROM jobs WHERE sweep_id = ?", (sweep_id,)).fetchone()
        return int(row[0])

    def results(self, sweep_id: int, num: int | None = None) -> dict[int, Result]:
        """The kept results of this sweep's attempts (or one job's): ``{attempt id: Result}``."""
        query, args = ("SELECT r.attempt_id, r.step, r.loss, r.peak_bytes, r.flags, r.memory FROM "
                       "results r JOIN attempts a ON a.id = r.attempt_id WHERE a.sweep_id = ?"), [sweep_id]
        if num is not None:
            query, args = query + " AND a.num = ?", [*args, num]
        return {attempt_id: Result(step, loss, peak, [] if flags == "[]" else json.loads(flags), memory)
                for attempt_id, step, loss, peak, flags, memory in self._db.execute(query, args)}

    def record_exclusions(self, excluded: Mapping[int, list[dict[str, Any]]]) -> None:
        """The nodes each attempt was submitted to avoid: ``{attempt id: [{node, why, attempt}]}``
        (``attempt``: the one that failed there), before its sbatch runs."""
        with self._write() as db:
            db.executemany("INSERT OR REPLACE INTO exclusions (attempt_id, nodes) VALUES (?, ?)",
                           [(i, json.dumps(nodes)) for i, nodes in excluded.items() if nodes])

    def exclusions(self, sweep_id: int, num: int | None = None) -> dict[int, list[dict[str, Any]]]:
        """``{attempt id: [{node, why, attempt}]}`` of this sweep's attempts (or one job's)."""
        query, args = ("SELECT e.attempt_id, e.nodes FROM exclusions e JOIN attempts a ON "
                       "a.id = e.attempt_id WHERE a.sweep_id = ?"), [sweep_id]
        if num is not None:
            query, args = query + " AND a.num = ?", [*args, num]
        return {attempt_id: json.loads(nodes) for attempt_id, nodes in self._db.execute(query, args)}

    def record_provenance(self, sweep_id: int, records: Mapping[int, dict[str, Any]]) -> None:
        """What each job runs (``{num: provenance}``: code snapshot, git commit and dirty tree,
        config hash, versions), kept here as well as in its run directory, so ``show`` still says
        it when the run directory is gone."""
        with self._write() as db:
            db.executemany("INSERT OR REPLACE INTO provenance (sweep_id, num, record) VALUES (?, ?, ?)",
                           [(sweep_id, num, json.dumps(data)) for num, data in records.items()])

    def provenance(self, sweep_id: int, num: int) -> dict[str, Any] | None:
        row = self._db.execute("SELECT record FROM provenance WHERE sweep_id = ? AND num = ?",
                               (sweep_id, num)).fetchone()
        return json.loads(row[0]) if row else None

    def record_search(self, sweep_id: int, study_path: str, settings: Mapping[str, Any]) -> None:
        with self._write() as db:
            db.execute("INSERT INTO searches (sweep_id, study_path, settings) VALUES (?, ?, ?)",
                       (sweep_id, study_path, json.dumps(settings, sort_keys=True)))

    def search(self, sweep_id: int) -> tuple[str, dict[str, Any]] | None:
        """``(study path, settings)`` of a search, None for any other sweep."""
        row = self._db.execute("SELECT study_path, settings FROM searches WHERE sweep_id = ?",
                               (sweep_id,)).fetchone()
        return (row[0], json.loads(row[1])) if row else None

    def record_trial(self, trial: Trial) -> None:
        """A trial as it now stands (asked, reported on, ended): the whole row, replaced."""
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO trials (sweep_id, num, params, state, step, value, error, "
                       "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (trial.sweep_id, trial.num, json.dumps(trial.params), trial.state, trial.step,
                        trial.value, trial.error, time.time()))

    def trials(self, sweep_id: int) -> list[Trial]:
        rows = self._db.execute("SELECT sweep_id, num, params, state, step, value, error, updated_at "
                                "FROM trials WHERE sweep_id = ? ORDER BY num", (sweep_id,))
        return [Trial(r[0], r[1], json.loads(r[2]), *r[3:]) for r in rows]

    def snapshots_in_use(self, since: float) -> tuple[set[str], list[str]]:
        """What ``switchyard snapshots prune`` must keep: the snapshot hashes recorded for jobs not
        yet ended and for every job of a sweep created at or after ``since`` (a failed one may be
        resubmitted, and resumes under its own snapshot), and the run directories of such jobs that
        have no record here (submitted before the registry kept provenance)."""
        ended = ",".join("?" * len(TERMINAL_STATES))
        live = (f"EXISTS (SELECT 1 FROM attempts a WHERE a.sweep_id = j.sweep_id AND a.num = j.num "
                f"AND a.state NOT IN ({ended}))")
        rows = self._db.execute(
            f"SELECT j.run_dir, p.record FROM jobs j JOIN sweeps s ON s.id = j.sweep_id "
            f"LEFT JOIN provenance p ON p.sweep_id = j.sweep_id AND p.num = j.num "
            f"WHERE s.created_at >= ? OR {live}", [since, *sorted(TERMINAL_STATES)])
        hashes, unrecorded = set(), []
        for run_dir, record in rows:
            if record is None:
                unrecorded.append(run_dir)
            elif isinstance(snap := json.loads(record).get("snapshot"), dict):
                hashes.add(str(snap.get("hash")))
        return hashes, unrecorded

    def keep_results(self, results: Iterable[tuple[Attempt, Result]]) -> None:
        """Keep what ended attempts left, each only if its attempt is still as it was read (an
        attempt that changed since, a requeue, would otherwise get its previous life's result)."""
        with self._write() as db:
            db.executemany(
                "INSERT OR REPLACE INTO results (attempt_id, step, loss, peak_bytes, flags, memory) "
                "SELECT ?, ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM attempts WHERE id = ? AND "
                "state = ? AND updated_at = ?)",
                [(a.id, r.step, r.loss, r.peak_bytes, json.dumps(r.flags), r.memory_json, a.id, a.state,
                  a.updated_at) for a, r in results])
            # rows an older Switchyard kept (the sampler now folds its own telemetry: telemetry/fold.py)
            db.executemany("DELETE FROM digests WHERE attempt_id = ?", [(a.id,) for a, _ in results])

    def find_attempt(self, slurm_id: str) -> Attempt | None:
        row = self._db.execute("SELECT * FROM attempts WHERE slurm_id = ? ORDER BY id DESC LIMIT 1",
                               (slurm_id,)).fetchone()
        return Attempt(**dict(row)) if row else None

    def unsettled(self, sweep_ids: Sequence[int] | None = None, nums: Sequence[int] | None = None
                  ) -> list[Unsettled]:
        """Attempts whose state may still change (of these sweeps, and of these jobs in them),
        with their run directory and executor; job rows are not decoded."""
        final = ",".join("?" * len(FINAL_STATES))
        requeuable = ",".join("?" * len(REQUEUABLE_STATES))
        query = (f"SELECT {_ATTEMPT_COLUMNS}, j.run_dir, s.executor FROM attempts a "
                 f"JOIN jobs j USING (sweep_id, num) JOIN sweeps s ON s.id = a.sweep_id "
                 f"WHERE a.state NOT IN ({final}) AND "
                 f"(a.state NOT IN ({requeuable}) OR a.updated_at > ?)")
        args: list[Any] = [*sorted(FINAL_STATES), *sorted(REQUEUABLE_STATES),
                           time.time() - RECHECK_REQUEUABLE_S]
        if sweep_ids is not None:
            query += f" AND a.sweep_id IN ({','.join('?' * len(sweep_ids))})"
            args += list(sweep_ids)
        if nums is not None:
            query += f" AND a.num IN ({','.join('?' * len(nums))})"
            args += list(nums)
        return [Unsettled(Attempt(*r[:-2]), r[-2], r[-1]) for r in self._db.execute(query, args)]


@dataclass(frozen=True)
class Unsettled:
    attempt: Attempt
    run_dir: str
    executor: str


# One sweep's latest attempt per job (argument: the sweep id). The sweep is picked inside the
# grouping, so its cost follows this sweep's attempts, not the whole registry's.
_LATEST_ATTEMPTS = (f"SELECT {_ATTEMPT_COLUMNS} FROM attempts a JOIN (SELECT sweep_id, num, "
                    "MAX(attempt) AS attempt FROM attempts WHERE sweep_id = ? GROUP BY sweep_id, num) "
                    "last USING (sweep_id, num, attempt)")


_NO_RESOURCES = "'{}' AS resources"


def _job(row: sqlite3.Row) -> Job:
    resources = row["resources"]
    return Job(sweep_id=row["sweep_id"], num=row["num"], overrides=json.loads(row["overrides"]),
               run_dir=row["run_dir"], resources={} if resources == "{}" else json.loads(resources),
               total_steps=row["total_steps"])


def _merge(row: dict[str, Any], o: Observation) -> dict[str, Any]:
    merged = dict(row, state=o.state, requeues=max(o.requeues, row["requeues"]))
    if o.requeues > row["requeues"]:  # a new life: the previous one's end is not this one's
        merged.update(ended_at=None, exit_code=None, error=None)
    for key in ("started_at", "ended_at", "exit_code", "node", "error"):
        value = getattr(o, key)
        if value is not None:
            merged[key] = value
    return merged
