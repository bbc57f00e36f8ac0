"""A registry file of every schema version this project has written opens and migrates, its
records kept; one written by a newer Switchyard is refused, naming both versions.

The old files are made here with the DDL those versions ran (``git log -G SCHEMA_VERSION``), not
with today's: a migration must meet what is really on users' disks.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.registry import db
from orchestrator.registry.db import Registry, RegistryError

V1 = """
CREATE TABLE IF NOT EXISTS sweeps (
    id INTEGER PRIMARY KEY AUTOINCREMENT, created_at REAL NOT NULL, app TEXT NOT NULL,
    command TEXT NOT NULL, sweep_dir TEXT NOT NULL, executor TEXT NOT NULL, entry_path TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    sweep_id INTEGER NOT NULL REFERENCES sweeps(id), num INTEGER NOT NULL, overrides TEXT NOT NULL,
    run_dir TEXT NOT NULL, resources TEXT NOT NULL, total_steps INTEGER, PRIMARY KEY (sweep_id, num));
CREATE TABLE IF NOT EXISTS attempts (
    id INTEGER PRIMARY KEY AUTOINCREMENT, sweep_id INTEGER NOT NULL, num INTEGER NOT NULL,
    attempt INTEGER NOT NULL, slurm_id TEXT, array_id TEXT, array_index INTEGER, state TEXT NOT NULL,
    requeues INTEGER NOT NULL DEFAULT 0, submitted_at REAL NOT NULL, started_at REAL, ended_at REAL,
    exit_code INTEGER, node TEXT, error TEXT, log_dir TEXT, updated_at REAL NOT NULL,
    UNIQUE (sweep_id, num, attempt), FOREIGN KEY (sweep_id, num) REFERENCES jobs(sweep_id, num));
CREATE INDEX IF NOT EXISTS attempts_by_state ON attempts(state);
"""
RESULTS = """CREATE TABLE IF NOT EXISTS results (
    attempt_id INTEGER PRIMARY KEY REFERENCES attempts(id), step INTEGER, loss REAL,
    peak_bytes INTEGER, flags TEXT NOT NULL, memory TEXT);"""
DIGESTS = """CREATE TABLE IF NOT EXISTS digests (
    attempt_id INTEGER PRIMARY KEY REFERENCES attempts(id), state TEXT NOT NULL);"""
EXCLUSIONS = """CREATE TABLE IF NOT EXISTS exclusions (
    attempt_id INTEGER PRIMARY KEY REFERENCES attempts(id), nodes TEXT NOT NULL);"""
PROVENANCE = """CREATE TABLE IF NOT EXISTS provenance (
    sweep_id INTEGER NOT NULL, num INTEGER NOT NULL, record TEXT NOT NULL, PRIMARY KEY (sweep_id, num));"""
# The whole schema each version made a new file with (69ab808, 67601fe, 18bb358, e3ec1df): version
# 5 made none of the exclusions table that version 4 had.
RELEASED = {1: V1, 2: V1 + RESULTS, 3: V1 + RESULTS + DIGESTS, 4: V1 + RESULTS + EXCLUSIONS + DIGESTS,
            5: V1 + RESULTS + PROVENANCE + DIGESTS}


def old_file(path: Path, version: int) -> Path:
    """A registry as Switchyard at ``version`` left it, with one sweep of one submitted job."""
    conn = sqlite3.connect(path)
    conn.executescript(RELEASED[version])
    conn.execute("INSERT INTO sweeps VALUES (1, 1.0, 'train', 'optim.lr=0.1', '/s', 'slurm', '')")
    conn.execute("INSERT INTO jobs VALUES (1, 0, '[\"optim.lr=0.1\"]', '/s/0', '{}', 100)")
    conn.execute("INSERT INTO attempts (sweep_id, num, attempt, slurm_id, state, submitted_at, updated_at) "
               "VALUES (1, 0, 1, '77', 'COMPLETED', 1.0, 2.0)")
    conn.execute(f"PRAGMA user_version = {version}")
    conn.commit()
    conn.close()
    return path


def schema(path: Path) -> dict[str, list[tuple[str, str, int, int]]]:
    """Each table's and index's columns (name, type, not null, primary key): what the code relies on."""
    with sqlite3.connect(path) as conn:
        names = [n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")]
        return {n: sorted((c[1], c[2], c[3], c[5]) for c in conn.execute(f"PRAGMA table_info({n})"))
                for n in names}


def version_of(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])


def test_the_migrations_are_one_ordered_step_per_version() -> None:
    assert [v for v, _ in db.MIGRATIONS] == list(range(1, db.SCHEMA_VERSION + 1))


@pytest.mark.parametrize("version", sorted(RELEASED))
def test_a_file_of_each_older_version_migrates_and_keeps_its_records(tmp_path: Path, version: int) -> None:
    path = old_file(tmp_path / "old.db", version)
    with Registry(tmp_path / "new.db"):
        pass
    with Registry(path) as reg:
        assert [(s.app, s.command) for s in reg.sweeps()] == [("train", "optim.lr=0.1")]
        assert [(a.slurm_id, a.state) for a in reg.attempts(1, 0)] == [("77", "COMPLETED")]
        assert len(reg.jobs(1)) == 1 and reg.results(1) == {}
        reg.record_provenance(1, {0: {"snapshot": None}})  # the newest table takes writes
    assert version_of(path) == db.SCHEMA_VERSION
    assert schema(path) == schema(tmp_path / "new.db")


def test_a_file_written_by_a_newer_switchyard_is_refused_naming_both_versions(tmp_path: Path) -> None:
    """It was relabelled as this version (its user_version overwritten) and read as if it were."""
    path = old_file(tmp_path / "r.db", 5)
    newer = db.SCHEMA_VERSION + 1
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {newer}")
    said = (rf"{path} was written by a newer Switchyard \(registry version {newer}; this one reads "
            rf"versions up to {db.SCHEMA_VERSION}\)")
    with pytest.raises(RegistryError, match=said):
        Registry(path)
    assert version_of(path) == newer


def tables_of(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {n for (n,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")}


@pytest.mark.parametrize("stamp", [0, -3])
def test_a_populated_file_whose_version_stamp_was_reset_names_the_damage_and_the_fix(
        tmp_path: Path, stamp: int) -> None:
    """A registry at user_version 0 or below that holds sweeps said "table sweeps already exists"
    (it was migrated as a new file): now the damage, the version its tables show and the command
    that restores the stamp, which then opens it with every record kept."""
    path = old_file(tmp_path / "r.db", 5)
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {stamp}")
    with pytest.raises(RegistryError) as refused:
        Registry(path)
    fix = f"import sqlite3; sqlite3.connect('{path}').execute('PRAGMA user_version = 5')"
    assert str(refused.value) == (
        f"the sweep registry {path} is damaged: its version stamp (PRAGMA user_version) is {stamp}, but "
        f"its tables are those of registry version 5 (something reset the stamp); restore it with "
        f"python -c \"{fix}\", or set SWITCHYARD_REGISTRY to another file")
    assert version_of(path) == stamp  # refused before anything was changed
    exec(fix)  # the fix, as the user would run it
    with Registry(path) as reg:
        assert [(a.slurm_id, a.state) for a in reg.attempts(1, 0)] == [("77", "COMPLETED")]
    assert version_of(path) == db.SCHEMA_VERSION


def test_a_file_of_other_tables_without_a_stamp_is_not_taken_for_a_registry(tmp_path: Path) -> None:
    """Registry tables were created beside the user's own in their SQLite file."""
    path = tmp_path / "notes.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE notes (text TEXT)")
    with pytest.raises(RegistryError, match=r"is not one: its version stamp \(PRAGMA user_version\) is 0 "
                                            r"and it holds tables no registry has \(notes\)"):
        Registry(path)
    assert tables_of(path) == {"notes"}


def test_the_tables_of_each_version_name_it(tmp_path: Path) -> None:
    """What the damage message proposes is right for every version written, and for this one: a
    new migration step must teach ``_version_of_tables`` its table."""
    for version in RELEASED:
        assert db._version_of_tables(tables_of(old_file(tmp_path / f"v{version}.db", version))) == version
    with Registry(tmp_path / "new.db"):
        pass
    assert db._version_of_tables(tables_of(tmp_path / "new.db")) == db.SCHEMA_VERSION


@pytest.mark.parametrize("stamp", [db.SCHEMA_VERSION + 1, 0])
def test_a_sweep_refused_for_its_registry_is_one_error_line_exit_2(tmp_path: Path, stamp: int) -> None:
    """As a single job says it: a sweep printed two lines, Hydra's HYDRA_FULL_ERROR hint and exit 1."""
    path = old_file(tmp_path / "r.db", 5)
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {stamp}")
    proc = subprocess.run([sys.executable, "-m", "jobs.train", "-m", "optim.lr=0.1,0.2",
                           f"hydra.sweep.dir={tmp_path / 'sweep'}"], capture_output=True, text=True,
                          env={**os.environ, "SWITCHYARD_REGISTRY": str(path)}, timeout=300)
    said = "was written by a newer Switchyard" if stamp else "is damaged: its version stamp"
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"error: the sweep registry {path} {said}") and "HYDRA" not in proc.stderr
    assert proc.stderr.count("the sweep registry") == 1
    assert not (tmp_path / "sweep" / ".switchyard").exists()  # nothing of the sweep recorded or submitted
