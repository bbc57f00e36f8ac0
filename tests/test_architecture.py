"""The direction of imports is the architecture: this test fails on an import against the grain.

Every import counts, also one inside a function (``from jobs import train`` in a launcher function
was the one that made ``orchestrator`` depend on its own app). Each first-party unit lists what it
may import; a new module of ``orchestrator`` must be placed in a unit here before it can pass.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = ("orchestrator", "sharding", "jobs", "hydra_plugins")

BASE = {"orchestrator.config", "orchestrator.atomic", "orchestrator.terminal"}
# unit -> the other first-party units it may import (a unit may always import itself)
ALLOWED: dict[str, set[str]] = {
    "sharding": set(),
    "orchestrator.config": set(),
    "orchestrator.atomic": set(),
    "orchestrator.terminal": set(),
    "orchestrator.localcluster": set(),
    "orchestrator.launch": BASE,
    "orchestrator.telemetry": BASE,
    "orchestrator.training": BASE | {"orchestrator.launch", "orchestrator.telemetry", "sharding"},
    "orchestrator.sweeps": BASE | {"orchestrator.launch", "orchestrator.telemetry",
                                   "orchestrator.training"},
    # your own command or function as a job: no trainer
    "orchestrator.scripts": BASE | {"orchestrator.launch", "orchestrator.telemetry", "orchestrator.sweeps"},
    "orchestrator.cli": BASE | {"orchestrator.launch", "orchestrator.telemetry", "orchestrator.training",
                                "orchestrator.sweeps", "orchestrator.scripts", "orchestrator.localcluster",
                                "sharding"},
    # the entry points and the Hydra plugin sit on top: they may import any unit above
    "jobs": {"orchestrator", "sharding"},
    "hydra_plugins": {"orchestrator"},
}


def unit_of(module: str) -> str | None:
    """``orchestrator.training.trainer`` -> ``orchestrator.training``; None for third-party modules."""
    parts = module.split(".")
    if parts[0] not in FIRST_PARTY:
        return None
    return ".".join(parts[:2]) if parts[0] == "orchestrator" and len(parts) > 1 else parts[0]


def may_import(importer: str, imported: str) -> bool:
    if imported == importer or imported == "orchestrator":  # the bare package holds only a docstring
        return True
    allowed = ALLOWED[importer]
    return imported in allowed or imported.split(".")[0] in allowed


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """Every module an import statement names, anywhere in the file (functions included)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield node.lineno, base
            for alias in node.names:  # `from orchestrator import training` imports a submodule
                yield node.lineno, f"{base}.{alias.name}"


def violations(root: Path) -> list[str]:
    found = []
    for top in FIRST_PARTY:
        for path in sorted((root / top).rglob("*.py")):
            module = module_name(path, root)
            importer = unit_of(module)
            if importer is None or importer == "orchestrator":
                continue
            if importer not in ALLOWED:
                found.append(f"{path.relative_to(root)}: unit {importer} is not placed in ALLOWED")
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            bad = {(line, unit) for line, name in imported_modules(tree, module, path.name == "__init__.py")
                   if (unit := unit_of(name)) is not None and not may_import(importer, unit)}
            where = path.relative_to(root)
            found += [f"{where}:{line}: {importer} imports {unit}" for line, unit in sorted(bad)]
    return found


def test_imports_follow_the_architecture() -> None:
    assert violations(ROOT) == []


@pytest.mark.parametrize(("where", "source", "expected"), [
    ("orchestrator/sweeps/launcher.py", "def check():\n    from jobs import train\n",
     "orchestrator.sweeps imports jobs"),
    ("orchestrator/training/trainer.py", "from orchestrator.sweeps import registry\n",
     "orchestrator.training imports orchestrator.sweeps"),
    ("orchestrator/training/trainer.py", "from orchestrator import sweeps\n",
     "orchestrator.training imports orchestrator.sweeps"),
    ("orchestrator/launch/submit.py", "from ..training import trainer\n",
     "orchestrator.launch imports orchestrator.training"),
    ("sharding/reader.py", "import orchestrator.config\n", "sharding imports orchestrator.config"),
    ("orchestrator/newthing.py", "x = 1\n", "unit orchestrator.newthing is not placed"),
])
def test_a_forbidden_import_is_caught(tmp_path: Path, where: str, source: str, expected: str) -> None:
    path = tmp_path / where
    path.parent.mkdir(parents=True)
    path.write_text(source)
    found = violations(tmp_path)
    assert len(found) == 1 and expected in found[0], found
