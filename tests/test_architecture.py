"""The direction of imports is the architecture: this test fails on an import against the grain.

Every import counts, also one inside a function (``from jobs import train`` in a launcher function
was the one that made ``orchestrator`` depend on its own app). Each first-party unit lists what it
may import; a new module of ``orchestrator`` must be placed in a unit here before it can pass.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = ("orchestrator", "sharding", "durable", "jobs", "hydra_plugins", "switchyard")

BASE = {"orchestrator.config", "durable", "orchestrator.terminal", "orchestrator.stop_signals",
        "orchestrator.entry", "orchestrator.quick_exit", "orchestrator.library_versions"}
# unit -> the other first-party units it may import (a unit may always import itself)
ALLOWED: dict[str, set[str]] = {
    # the data layer stands alone: nothing of orchestrator, only the atomic writes below both
    "sharding": {"durable"},
    "durable": set(),  # the standard library alone
    "orchestrator.config": set(),
    "orchestrator.terminal": set(),
    "orchestrator.entry": {"orchestrator.terminal", "orchestrator.library_versions"},
    "orchestrator.library_versions": set(),
    "orchestrator.quick_exit": set(),
    "orchestrator.stop_signals": set(),
    "orchestrator.localcluster": set(),
    # what was submitted and what became of it: single jobs (launch) and sweeps both record into it
    "orchestrator.registry": BASE,
    "orchestrator.launch": BASE | {"orchestrator.registry"},
    "orchestrator.telemetry": BASE,
    "orchestrator.training": BASE | {"orchestrator.launch", "orchestrator.telemetry", "sharding"},
    "orchestrator.sweeps": BASE | {"orchestrator.registry", "orchestrator.launch", "orchestrator.telemetry",
                                   "orchestrator.training", "orchestrator.export"},
    # checkpoints as files other tools load: reads the training's checkpoints and rebuilds its models
    "orchestrator.export": BASE | {"orchestrator.training", "sharding"},
    # a hyperparameter search: its trials are jobs (launch), its views extend the sweeps' (sweeps)
    "orchestrator.search": BASE | {"orchestrator.registry", "orchestrator.launch", "orchestrator.sweeps"},
    # your own command or function as a job: no trainer
    "orchestrator.scripts": BASE | {"orchestrator.registry", "orchestrator.launch", "orchestrator.telemetry"},
    "orchestrator.cli": BASE | {"orchestrator.registry", "orchestrator.launch", "orchestrator.telemetry",
                                "orchestrator.training", "orchestrator.sweeps", "orchestrator.scripts",
                                "orchestrator.export", "orchestrator.search",
                                "orchestrator.localcluster", "sharding"},
    # the entry points and the Hydra plugin sit on top: they may import any unit above
    "jobs": {"orchestrator", "sharding", "durable"},
    "hydra_plugins": {"orchestrator"},
    "switchyard": {"orchestrator"},  # the function API: your own code submits through it
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
    ("orchestrator/training/trainer.py", "from orchestrator.sweeps import launcher\n",
     "orchestrator.training imports orchestrator.sweeps"),
    ("orchestrator/training/trainer.py", "from orchestrator import sweeps\n",
     "orchestrator.training imports orchestrator.sweeps"),
    ("orchestrator/launch/submit.py", "from ..training import trainer\n",
     "orchestrator.launch imports orchestrator.training"),
    ("sharding/reader.py", "import orchestrator.config\n", "sharding imports orchestrator.config"),
    # the registry is below single jobs (launch) and sweeps: SLURM is asked through a function given
    ("orchestrator/registry/reconciliation.py", "def ask():\n    from orchestrator.launch import submit\n",
     "orchestrator.registry imports orchestrator.launch"),
    ("orchestrator/registry/db.py", "from orchestrator.sweeps import status\n",
     "orchestrator.registry imports orchestrator.sweeps"),
    ("orchestrator/newthing.py", "x = 1\n", "unit orchestrator.newthing is not placed"),
])
def test_a_forbidden_import_is_caught(tmp_path: Path, where: str, source: str, expected: str) -> None:
    path = tmp_path / where
    path.parent.mkdir(parents=True)
    path.write_text(source)
    found = violations(tmp_path)
    assert len(found) == 1 and expected in found[0], found


def module_graph(root: Path) -> dict[str, set[str]]:
    """Each first-party module -> the first-party modules it imports (a package's ``__init__``
    counts as the package; ``from pkg import name`` counts as ``pkg.name`` where that is a module)."""
    paths = {module_name(path, root): path
             for top in FIRST_PARTY for path in sorted((root / top).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        names = {name for _, name in imported_modules(tree, module, path.name == "__init__.py")}
        graph[module] = {name for name in names if name in paths and name != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_round_a_loop() -> None:
    """Modules import one way, inside a unit too, whether the import is at the top of the file or
    inside a function: the sweep launcher and ``status`` imported each other (each from inside a
    function) until what both need moved below them (sweeps.results, sweeps.arrays); the trainer
    and the memory estimate did (the estimate for the step's maths, the trainer for the estimate's
    report, and the micro-batcher from inside a function) until the step moved into ``step``."""
    assert cycles(module_graph(ROOT)) == []


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), set()) - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


@pytest.mark.parametrize("entry", ["jobs.train", "orchestrator.scripts.job", "orchestrator.scripts.function"])
def test_a_single_job_does_not_pass_through_sweeps(entry: str) -> None:
    """A single job is recorded in the registry from launch/: it went up into sweeps/ (single,
    registry) and back down into launch/ eight times on its way from jobs/train.py."""
    assert sorted(m for m in reached(module_graph(ROOT), entry) if unit_of(m) == "orchestrator.sweeps") == []


def test_an_import_loop_is_caught(tmp_path: Path) -> None:
    sweeps = tmp_path / "orchestrator" / "sweeps"
    sweeps.mkdir(parents=True)
    (sweeps / "launcher.py").write_text("def settle():\n    from orchestrator.sweeps.status import keep\n")
    (sweeps / "status.py").write_text("def resubmit():\n    from orchestrator.sweeps import launcher\n")
    (sweeps / "registry.py").write_text("x = 1\n")
    assert cycles(module_graph(tmp_path)) == [["orchestrator.sweeps.launcher", "orchestrator.sweeps.status"]]


HEAVY = ("torch._dynamo", "torch._inductor", "torch.distributed.tensor", "torch.distributed.checkpoint",
         "torch.distributed.fsdp", "torch.distributed._tools")


def test_the_submitting_process_imports_no_compiler_fsdp_or_dcp() -> None:
    """`python -m jobs.train` only checks and submits: torch's compiler stack, DTensor, FSDP2 and DCP
    (pulled in by the memory estimate's trackers, the fsdp strategy and sharded checkpoints) cost it
    about a second of CPU at every start when imported at the top. They are imported where used."""
    import subprocess
    import sys

    code = (f"import sys, jobs.train; print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_rank_wrapper_of_a_users_command_imports_no_torch() -> None:
    """`switchyard run`'s rank wrapper starts the user's command, which imports torch itself: only
    rank 0's wrapper, which serves the job's TCPStore, imports torch.distributed, when it serves."""
    import subprocess
    import sys

    code = "import sys, orchestrator.scripts.rank; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_status_commands_import_neither_torch_nor_hydra() -> None:
    """`switchyard status`, `show`, `logs` and `cancel` only read the registry and the run
    directories; a user polls them by hand or in a loop, so their start is kept to the standard
    library, the registry and psutil: no torch, and no Hydra (the config's schemas are read as
    types, never composed)."""
    import subprocess
    import sys

    code = ("import sys, orchestrator.cli, orchestrator.sweeps.status; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'hydra', 'numpy'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_module_is_named_in_the_architecture_page() -> None:
    """docs/architecture.md names every module in one line ("Every module"), and only modules that
    exist: a newcomer finds each concern there."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page[page.index("## Every module"):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    modules = [str(p.relative_to(ROOT)) for top in FIRST_PARTY for p in sorted((ROOT / top).rglob("*.py"))
               if p.name not in ("__init__.py", "__main__.py")]
    missing = [m for m in modules if f"| `{m}` |" not in section]
    assert missing == [], f"docs/architecture.md's 'Every module' has no line for {missing}: add one each"
    named = [m for m in re.findall(r"^\| `([^`]+\.py)` \|", section, re.MULTILINE) if m not in modules]
    assert named == [], f"docs/architecture.md's 'Every module' names modules that do not exist: {named}"
