"""One export: check OUT, read the checkpoint, write the format, reload it and compare, record
``export.json``, publish by rename. ``switchyard export`` and the in-training exporter's
subprocess (``python -m orchestrator.export``) both call ``export``.

``export.json``: the source run, the checkpoint and its checksum, the step, the code snapshot's
hash, the files, the comparison (max |logit difference|, parameter counts) and the process's peak
host memory (``ru_maxrss``: torch's import included). ``RUN/exports.jsonl`` gets one line per
export, which ``switchyard show`` lists.
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path
from typing import Any

from durable.atomic import write_json
from orchestrator.config import EXPORT_FORMATS
from orchestrator.export import formats, publish, source, verify
from orchestrator.export.record import EXPORT_FILE, remember
from orchestrator.export.source import ExportError
from orchestrator.training import resume


class VerificationError(RuntimeError):
    """The export reloaded to other logits or another parameter count: nothing was published."""


def export(run_dir: Path | None, fmt: str, out: Path, *, step: int | None = None,
           checkpoint_path: Path | None = None, recorded_as: Path | None = None,
           overwrite: bool = False, shard_mb: float = 5000) -> dict[str, Any]:
    """Export ``step`` (the newest when None) of ``run_dir``, or ``checkpoint_path``, as ``fmt``
    into ``out``; returns export.json's content. ``recorded_as``: the checkpoint's own path, when
    ``checkpoint_path`` is a staged link to it (the in-training exporter)."""
    started = time.perf_counter()
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"--format {fmt}: must be one of {', '.join(EXPORT_FORMATS)} (try --format hf)")
    if fmt == "hf":
        _need_transformers()  # before reading a multi-GB checkpoint
    if checkpoint_path is not None:
        path = checkpoint_path
    elif run_dir is not None:
        path = source.find(run_dir, step)
    else:
        raise ExportError("nothing to export: name a run directory")
    protected = [p for p in (run_dir, recorded_as or path) if p is not None]
    publish.check_out(out, overwrite, protected)
    found = source.open_source(path, run_dir)
    model = source.build(found)
    if fmt == "hf":
        formats.check_hf(model)  # a model transformers cannot represent: refused before any write
    with publish.publishing(out, overwrite) as partial:
        files = formats.write(fmt, model, found, partial, shard_mb)
        reloaded = formats.reload_hf(partial, next(model.parameters()).dtype) if fmt == "hf" else \
            formats.reload_safetensors(partial, _empty(found))
        batch = verify.fixed_batch(resume.model_of(found.state["compat"])[1])
        result = verify.compare(model, reloaded, batch,  # the checkpoint's own model, as trained
                                reloaded.state_dict() if fmt == "safetensors" else None)
        if not result["passed"]:
            raise VerificationError(
                f"the export of {recorded_as or path} did not reload to the checkpoint's model "
                f"({_describe(result)}): nothing was written to {out}")
        record = {"format": fmt, "source_run": str(run_dir) if run_dir else None,
                  "checkpoint": str(recorded_as or path), "step": found.step,
                  "checkpoint_checksum": found.checksum, "code_hash": found.code_hash,
                  "model": found.model_spec.get("_target_"), **files,
                  "max_abs_diff": result["max_abs_diff"], "verification": result,
                  "peak_host_bytes": peak_host_bytes(), "seconds": time.perf_counter() - started,
                  "created_at": time.time(), "path": str(out.resolve())}
        write_json(partial / EXPORT_FILE, record, indent=1)
    if run_dir is not None:
        remember(run_dir, record)
    return record


def _need_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ExportError("--format hf needs transformers: pip install 'switchyard[hf]' (or use "
                          "--format safetensors)") from e


def _empty(found: source.Source) -> Any:
    """The checkpoint's model rebuilt from its config alone, for the export's weights to fill."""
    from orchestrator.config import MemoryConfig
    from orchestrator.training.step import build_model

    spec, dataset_kwargs = resume.model_of(found.state["compat"])
    return build_model(spec, dataset_kwargs, MemoryConfig())


def _describe(result: dict[str, Any]) -> str:
    parts = [f"max |logit difference| {result.get('max_abs_diff')} (tolerance {result['tolerance']})",
             f"parameters {result['parameters_reloaded']} vs {result['parameters']}"]
    if result.get("weights_equal") is False:
        parts.append("weights differ")
    if result.get("why"):
        parts.append(result["why"])
    return ", ".join(parts)


def peak_host_bytes() -> int:
    """This process's peak resident memory so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
