"""``switchyard plot RUN``: memory over time per GPU (per rank on CPU) to a PNG, flags in its title."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator.telemetry.common import GIB, Record, TelemetryError, gib
from orchestrator.telemetry.files import telemetry_dir
from orchestrator.telemetry.flags import heavy_gpus, is_idle
from orchestrator.telemetry.fold import read_digest, read_series
from orchestrator.telemetry.stats import Digest, GpuStats, load_records
from orchestrator.telemetry.summary import summary_of


def plot_run(run_dir: Path, out: Path | None = None, raw: bool = False) -> Path:
    """Memory over time, one subplot per node, one line per GPU (per rank on CPU) -> a PNG path.

    Draws each node's downsampled series (at most ``fold.MAX_POINTS`` points, each the peak of the
    samples it stands for), or with ``raw`` every sample. Default output:
    ``RUN/telemetry/memory.png``. Raises :class:`TelemetryError` when nothing was sampled or
    matplotlib is missing.
    """
    figure = memory_figure(run_dir, raw)
    path = Path(out) if out is not None else telemetry_dir(run_dir) / "memory.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path


def memory_figure(run_dir: Path, raw: bool = False) -> Any:
    """The matplotlib Figure ``plot_run`` saves."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise TelemetryError("plotting needs matplotlib: pip install matplotlib") from e
    notes: list[str] = []
    if raw:
        records = load_records(run_dir)
        digest = Digest.of(records)
    else:
        records, notes = read_series(run_dir)
        digest, _ = read_digest(run_dir)
    if not records:
        raise TelemetryError(f"no telemetry samples in {telemetry_dir(run_dir)}: was the memory sampler "
                             f"started (it runs on local rank 0 of each node)?")
    marks = _verdicts(digest.gpu_list())
    flags = summary_of(run_dir, digest)["flags"] + notes
    nodes = sorted({r["node"] for r in records})
    # the Figure/Agg API touches no pyplot global state, so plotting is safe from any thread
    figure = Figure(figsize=(10, 3.2 * len(nodes) + 0.25 * min(len(flags), 8) + 0.6))
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(nodes), 1, squeeze=False)[:, 0]
    for ax, node in zip(axes, nodes, strict=True):
        _plot_node(ax, [r for r in records if r["node"] == node], records[0]["t"], node, marks)
    _plot_titles(figure, Path(run_dir).name, flags)
    return figure


def _verdicts(stats: list[GpuStats]) -> dict[tuple[str, int], str]:
    marks = {(g.node, g.index): "idle" for g in stats if is_idle(g)}
    for g, median in heavy_gpus(stats):
        marks[(g.node, g.index)] = f"{g.peak_used_bytes / median:.1f}x peers" if median > 0 else "heavy"
    return marks


def _plot_node(ax: Any, records: list[Record], t0: float, node: str,
               marks: Mapping[tuple[str, int], str]) -> None:
    """One node's lines, one segment per attempt: a requeued job's lines break at the requeue
    instead of joining its last sample to the next attempt's first, and the gap is shaded and
    labelled (``_mark_gaps``). A GPU's legend entry carries its verdict ("idle", "2.1x peers")."""
    series: dict[tuple[str, int], tuple[list[float], list[float]]] = {}  # (label, attempt) -> x, y
    for record in records:
        x, attempt = record["t"] - t0, int(record.get("attempt", 0))
        for g in record.get("gpus") or []:
            if "error" not in g:
                mark = marks.get((node, g["index"]))
                label = f"GPU {g['index']} ({gib(g['total_bytes'])} GiB){f', {mark}' if mark else ''}"
                _append(series, (label, attempt), x, g["used_bytes"])
        for r in record.get("ranks") or []:
            _append(series, (f"rank {r['rank']} RSS", attempt), x, r["rss_bytes"])
            if r.get("uss_bytes") is not None:
                _append(series, (f"rank {r['rank']} USS", attempt), x, r["uss_bytes"])
    colours: dict[str, str] = {}  # one colour per GPU or rank: a rank's RSS solid, its USS dashed
    for (label, _), (xs, ys) in series.items():  # first-seen order: GPUs and ranks by number
        colour = colours.setdefault(label.removesuffix(" USS").removesuffix(" RSS"), f"C{len(colours) % 10}")
        style = "--" if label.endswith("USS") else "-"
        shown = any(line.get_label() == label for line in ax.get_lines())  # an earlier attempt's
        ax.plot(xs, ys, label="_" + label if shown else label, color=colour, linestyle=style,
                marker=".", markersize=3)
    _mark_gaps(ax, records, t0)
    ax.set_title(node)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("memory used (GiB)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize="small", ncol=2)


def attempt_gaps(records: list[Record]) -> list[tuple[int, float, float, str]]:
    """(next attempt, end of the one before, start of it, why the one before ended) for each
    change of attempt in one node's records, oldest first. An attempt whose last sample says
    nothing (killed before its sampler stopped) ended "without a last sample"."""
    gaps = []
    for before, after in itertools.pairwise(records):
        if after.get("attempt", 0) != before.get("attempt", 0):
            gaps.append((int(after.get("attempt", 0)), before["t"], after["t"],
                         str(before.get("ended") or "without a last sample")))
    return gaps


def _mark_gaps(ax: Any, records: list[Record], t0: float) -> None:
    for attempt, end, start, why in attempt_gaps(records):
        ax.axvspan(end - t0, start - t0, color="grey", alpha=0.15, linewidth=0)
        ax.annotate(f"attempt {attempt}: previous ended ({why}),\n{start - end:.0f} s idle",
                    xy=((end + start) / 2 - t0, 1), xycoords=("data", "axes fraction"),
                    xytext=(0, -4), textcoords="offset points", ha="center", va="top", fontsize=7)


def _append(series: dict[tuple[str, int], tuple[list[float], list[float]]], key: tuple[str, int],
            x: float, used: int) -> None:
    xs, ys = series.setdefault(key, ([], []))
    xs.append(x)
    ys.append(used / GIB)


def _plot_titles(figure: Any, run_name: str, flags: list[str]) -> None:
    figure.suptitle(f"{run_name}: memory over time, {len(flags)} flag{'s' * (len(flags) != 1)}")
    shown = [f"! {f[:150]}" for f in flags[:8]]
    shown += [f"... and {len(flags) - 8} more"] if len(flags) > 8 else []
    line_height = 0.25 / figure.get_figheight()  # 0.25 inch per flag line, as a fraction of the figure
    bottom = 0.02 + line_height * len(shown)
    for i, line in enumerate(shown):
        figure.text(0.01, bottom - (i + 1) * line_height, line, fontsize=7, color="firebrick")
    figure.tight_layout(rect=(0, bottom, 1, 0.96))
