"""``model.compile=true`` (``orchestrator.training.compiling``) on a real one-rank process group:
a compiled run trains as the eager one under ddp and fsdp, bf16, activation checkpointing and
gradient accumulation; checkpoints go both ways between compiled and eager runs; the compile cache
is published, loaded by a resume, and ignored with a warning when it is another torch's or damaged;
recompiles are counted and bounded. ``optim.implementation`` is recorded and a resume may change it.

Most tests compile with ``aot_eager`` (dynamo and AOTAutograd, no code generation: seconds on CPU);
one compiles with inductor."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._inductor.utils
from rank_helpers import write_rows_dataset, write_text_dataset
from train_helpers import CHEAP, refusal, run_train

from orchestrator.config import (
    CausalLmTaskConfig,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    GptConfig,
    LoggerConfig,
    MemoryConfig,
    OptimConfig,
    ParallelismConfig,
    TelemetryConfig,
    TrainConfig,
    TransformerConfig,
)
from orchestrator.training import compiling, runtime, step, trainer


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> trainer.DataPaths:
    return trainer.DataPaths(train=write_text_dataset(tmp_path_factory.mktemp("text")), eval=None)


def config(data: trainer.DataPaths, compile: bool = True, backend: str = "aot_eager", steps: int = 4,
           strategy: str = "ddp", amp: str = "none", checkpointing: bool = False, accum: int = 1,
           implementation: str = "auto", checkpoints: Path | None = None) -> TrainConfig:
    return TrainConfig(
        model=GptConfig(d_model=16, num_heads=2, num_layers=2, compile=compile, compile_backend=backend),
        task=CausalLmTaskConfig(), data=DataConfig(path=data.train, seq_len=16, batch_size=4),
        optim=OptimConfig(max_steps=steps, grad_accum_steps=accum, implementation=implementation),
        parallelism=ParallelismConfig(strategy=strategy),
        memory=MemoryConfig(amp=amp, activation_checkpointing=checkpointing),
        checkpoint=CheckpointConfig(dir=str(checkpoints) if checkpoints else None, async_save=False),
        log_every_steps=2, logger=LoggerConfig(tensorboard=False), telemetry=TelemetryConfig(enabled=False))


def train(rt: runtime.Runtime, data: trainer.DataPaths, run: Path, cfg: TrainConfig) -> dict[str, Any]:
    run.mkdir(parents=True, exist_ok=True)
    torch._dynamo.reset()  # each run compiles as a new process would (the cache is the file's)
    rank_trainer = trainer.Trainer(cfg, data, run, rt)
    return {**rank_trainer.run(), "startup_s": rank_trainer.clock.startup_s()}  # as rank_process adds it


@pytest.mark.parametrize("options", [
    {"strategy": "ddp"},
    {"strategy": "fsdp"},
    {"strategy": "ddp", "amp": "bf16", "checkpointing": True, "accum": 2},
    {"strategy": "fsdp", "amp": "bf16", "checkpointing": True},
], ids=["ddp", "fsdp", "ddp-bf16-checkpointing-accum", "fsdp-bf16-checkpointing"])
def test_a_compiled_run_trains_as_the_eager_one(rank: runtime.Runtime, data: trainer.DataPaths,
                                               tmp_path: Path, options: dict[str, Any]) -> None:
    eager = train(rank, data, tmp_path / "eager", config(data, compile=False, **options))
    compiled = train(rank, data, tmp_path / "compiled", config(data, **options))
    # aot_eager runs the same ATen ops as eager, traced: equal to float rounding
    assert math.isclose(compiled["final_train_loss"], eager["final_train_loss"], rel_tol=1e-5)
    report = compiled["compile"]
    assert report["units"] == 2 and report["recompiles"] == 0  # each block, the step's shape once
    assert eager["compile"] is None and "compile" not in eager["startup_s"]
    assert compiled["startup_s"]["compile"] > 0  # its own phase, before the first step


def test_checkpoints_resume_from_compiled_to_eager_and_back_exactly(
        rank: runtime.Runtime, data: trainer.DataPaths, tmp_path: Path) -> None:
    """The compiled modules keep their parameter names (``module.compile()`` in place), so the
    checkpoints are the eager run's: 2 compiled steps + 2 eager ones, and 2 eager + 2 compiled,
    both end on the uninterrupted eager run's weights."""
    straight = train(rank, data, tmp_path / "straight", config(data, compile=False, steps=4))
    for first, then in ((True, False), (False, True)):
        run = tmp_path / f"from-{'compiled' if first else 'eager'}"
        train(rank, data, run, config(data, compile=first, steps=2))
        resumed = train(rank, data, run, config(data, compile=then, steps=4))
        assert resumed["resumed_from"]["step"] == 2
        assert resumed["param_checksum_per_rank"] == straight["param_checksum_per_rank"]


def test_the_cache_is_published_loaded_at_a_resume_and_a_bad_one_ignored(
        rank: runtime.Runtime, data: trainer.DataPaths, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """inductor: the one real code-generating compile of this file (tens of seconds on CPU). The
    resume stands for a requeue on another node: an empty inductor cache and no kernel in memory.
    torch's artifacts hold inductor's C++ source, not the built kernels: until the file carried
    them, that resume built every kernel again with the compiler."""
    run = tmp_path / "run"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "node1"))
    first = train(rank, data, run, config(data, backend="inductor", steps=2))
    assert first["compile"]["cache"] == "published"
    # inductor's generated code trains as eager does (fp32: to rounding), so a gap between the two
    # on a GPU (docs/gpus.md) is the GPU's kernels, not the compiling
    eager = train(rank, data, tmp_path / "eager", config(data, compile=False, steps=2))
    assert math.isclose(first["final_train_loss"], eager["final_train_loss"], rel_tol=1e-5)
    [cache] = (run / compiling.CACHE_DIR).iterdir()
    node2 = tmp_path / "node2"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(node2))
    torch._inductor.utils.clear_caches()  # the kernels this process loaded, as a new process
    resumed = train(rank, data, run, config(data, backend="inductor", steps=3))
    assert resumed["compile"]["cache"] == "loaded" and resumed["compile"]["warnings"] == []
    header = json.loads(cache.read_bytes().split(b"\n", 2)[1])
    carried = {name for name, _ in header.get("kernels", [])}
    assert compiling.binaries(node2) - carried == set()  # built none: each came in the file
    assert any(name.endswith(".so") for name in carried)

    good = cache.read_bytes()
    cache.write_bytes(good.replace(torch.__version__.encode(), b"0.0.1", 1))
    other = train(rank, data, run, config(data, backend="inductor", steps=4))
    assert other["compile"]["warnings"] == [
        f"ignored the compile cache {cache}: written by torch 0.0.1, this is torch {torch.__version__}; "
        f"compiling from scratch"]
    assert other["compile"]["cache"] == "published"  # rank 0 replaced it with its own
    # damaged: refused by the same load_cache, before a kernel lands in a node's code cache (a run
    # around it would train as the torch-version case above did)
    node3 = tmp_path / "node3"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(node3))
    cache.write_bytes(good[:-10] + b"0123456789")  # the last kernel's tail
    assert compiling.load_cache(cache) == (False, f"ignored the compile cache {cache}: its checksum "
                                                  f"does not match (damaged); compiling from scratch")
    assert compiling.binaries(node3) == set()


@pytest.mark.parametrize(("kernels", "why"), [
    ([["../../evil.so", 3]], "a kernel named '../../evil.so'"),
    ([["ab/cabc.so", 2]], "the kernels' sizes do not add up to the file's"),
    ([], "the kernels' sizes do not add up to the file's"),
], ids=["outside-the-code-cache", "short", "undeclared-bytes"])
def test_a_cache_whose_kernels_do_not_fit_its_header_is_ignored_and_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: list[list[Any]], why: str) -> None:
    """A checksum only says the file is as its writer left it: the kernel names and sizes are
    still checked before a byte lands in the node's code cache."""
    node = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(node))
    payload = b"torch" + b"so!"
    header = {"torch": torch.__version__, "bytes": len(payload), "artifacts": 5, "kernels": kernels,
              "xxh3": compiling.xxhash.xxh3_64_hexdigest(payload)}
    path = tmp_path / "run" / "cache.bin"
    path.parent.mkdir()
    path.write_bytes(compiling.MAGIC + json.dumps(header).encode() + b"\n" + payload)
    assert compiling.load_cache(path) == (
        False, f"ignored the compile cache {path}: unreadable ({why}); compiling from scratch")
    assert not (tmp_path / "evil.so").exists() and compiling.binaries(node) == set()


@pytest.mark.parametrize("header", [b"null", b"[1, 2]", b"7"], ids=["null", "list", "number"])
def test_a_cache_whose_header_is_not_an_object_is_ignored_with_a_warning(tmp_path: Path,
                                                                         header: bytes) -> None:
    """Valid JSON but no header: it was an AttributeError (``header.get``) at every resume and
    requeue of the run until the file was deleted by hand; now a warning and a cold compile, as
    for any damaged cache."""
    path = tmp_path / "cache.bin"
    path.write_bytes(compiling.MAGIC + header + b"\n" + b"payload")
    kind = type(json.loads(header)).__name__
    assert compiling.load_cache(path) == (
        False, f"ignored the compile cache {path}: unreadable (its header is a JSON {kind}, not an "
               f"object); compiling from scratch")


def as_column(x: torch.Tensor) -> torch.Tensor:
    return x.view(-1, 1)  # a view: inductor saves its graph and has no kernel to build (seconds)


@pytest.mark.parametrize("blocked", ["dir-is-a-file", "file-is-a-dir"])
def test_a_cache_that_cannot_be_published_is_a_warning_and_the_run_goes_on(
        data: trainer.DataPaths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blocked: str) -> None:
    """``RUN/compile_cache`` a file (or the cache file's name a directory; a read-only or full disk
    fails the same write) raised FileExistsError / IsADirectoryError after the whole cold compile,
    with 0 steps trained. Publishing only spares a later attempt its compile: one warning naming
    the path and the cause, and the compiled run goes on. A real inductor compile of one
    view: eager backends save nothing, so nothing would be written."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    run = tmp_path / "run"
    run.mkdir()
    cfg = config(data, backend="inductor")
    path = compiling.cache_path(cfg, run)
    if blocked == "dir-is-a-file":
        path.parent.write_text("mine\n")
    else:
        path.mkdir(parents=True)
    torch._dynamo.reset()
    compiled = torch.compile(as_column, backend="inductor")
    spec = compiling.CompileSpec(enabled=True, backend="inductor")
    report, _ = compiling.prepare(spec, 1, cfg, run, True, lambda: compiled(torch.ones(3)))
    assert report.cache == "unpublished"
    [warning] = report.warnings
    assert warning.startswith(f"could not publish the compile cache {path}: ")
    assert ("File exists (FileExistsError)" if blocked == "dir-is-a-file"
            else "Is a directory (IsADirectoryError)") in warning
    assert warning.endswith("training on, and a resume or requeue of this run compiles again")
    assert (path.parent.read_text() == "mine\n") if blocked == "dir-is-a-file" else path.is_dir()

class Rows(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


@pytest.fixture
def torch_logs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str | None]:
    """The user's ``TORCH_LOGS``, as torch reads it when a process starts; torch's default after."""
    if request.param is not None:
        monkeypatch.setenv("TORCH_LOGS", request.param)
    torch._logging._internal._init_logs()
    yield request.param
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    torch._logging._internal._init_logs()


@pytest.mark.parametrize("torch_logs", [None, "graph_breaks"], indirect=True, ids=["unset", "other-logs"])
def test_recompiles_past_the_limit_fail_naming_the_guard(torch_logs: str | None) -> None:
    """A block called with a new shape every time, dynamic shapes off: one compile per shape, and
    the limit's failure names the guard that failed instead of torch's bare message. With the
    user's TORCH_LOGS naming other logs, torch wrote no recompile record: none was counted and
    the failure named no guard."""
    model = Rows()
    torch._dynamo.reset()
    compiling.compile_in_place(model, compiling.CompileSpec(enabled=True, backend="eager", dynamic=False), [])
    recompiles = compiling.watch_recompiles(2)
    with pytest.raises(compiling.RecompileLimitError) as failed, compiling.limit_errors(recompiles, 2):
        for rows in range(1, 6):
            model(torch.zeros(rows, 4))
    assert recompiles.count >= 1
    assert "past model.compile_recompile_limit=2" in str(failed.value)
    assert "size mismatch at index 0" in str(failed.value)  # torch's own words for the guard
    if torch_logs:  # the user's own choice stays on
        assert torch._logging._internal.log_state.is_artifact_enabled(torch_logs)


def test_an_optimizer_implementation_is_recorded_and_a_resume_may_change_it(
        rank: runtime.Runtime, data: trainer.DataPaths, tmp_path: Path) -> None:
    """Loading the optimizer's state takes the checkpoint's parameter groups, fused/foreach flags
    included: without ``apply_optim``'s kernels a resume ran the writer's implementation."""
    run = tmp_path / "run"
    first = train(rank, data, run, config(data, compile=False, steps=2, implementation="fused"))
    assert first["optim_implementation"] == "fused"
    resumed = train(rank, data, run, config(data, compile=False, steps=4, implementation="for-loop"))
    assert resumed["optim_implementation"] == "for-loop"
    assert resumed["resumed_from"]["config_changes"]["optim.implementation"] == ["fused", "for-loop"]
    straight = train(rank, data, tmp_path / "straight", config(data, compile=False, steps=4))
    assert straight["optim_implementation"] == "foreach"  # auto on a CPU
    assert math.isclose(resumed["final_train_loss"], straight["final_train_loss"], rel_tol=1e-4)


@pytest.mark.parametrize(("implementation", "device", "refusal"), [
    ("auto", "cuda", "optim.implementation='auto' (here: fused) is not available here: no fused kernel "
                     "(try optim.implementation=foreach or optim.implementation=for-loop)"),
    ("fused", "cpu", "optim.implementation='fused' is not available here: no fused kernel "
                     "(try optim.implementation=foreach or optim.implementation=for-loop)"),
])
def test_a_fused_kernel_torch_lacks_is_refused_naming_the_value_and_the_other_choices(
        monkeypatch: pytest.MonkeyPatch, implementation: str, device: str, refusal: str) -> None:
    """A torch whose optimizer refuses ``fused=True`` on the device (a mocked CUDA build): auto
    had chosen fused, yet the refusal offered "or auto", the value that failed."""
    real = torch.optim.AdamW

    def without_fused(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
        if kwargs.get("fused"):
            raise RuntimeError("no fused kernel")
        return real(params, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", without_fused)
    with pytest.raises(ConfigError) as refused:
        step.build_optimizer([torch.nn.Parameter(torch.zeros(2))], OptimConfig(implementation=implementation),
                             torch.device(device))
    assert str(refused.value) == refusal


def test_compile_with_auto_microbatch_and_a_bad_mode_are_refused_before_submission() -> None:
    assert refusal("model.compile=true", "memory.auto_microbatch=true").startswith(
        "error: memory.auto_microbatch=True is invalid: model.compile=true is not tested with it: ")
    assert refusal("model=gpt", "task=causal_lm", "model.compile_mode=fast").startswith(
        "error: model.compile_mode='fast' is invalid: choose one of ")


def test_custom_models_take_the_compile_keys_without_passing_them_on() -> None:
    kwargs, spec = compiling.split({"_target_": "x.Y", "width": 3, "compile": True,
                                    "compile_backend": "eager"})
    assert kwargs == {"_target_": "x.Y", "width": 3}
    assert spec == compiling.CompileSpec(enabled=True, backend="eager")
    assert json.dumps(dataclasses.asdict(spec))  # summary-ready


@pytest.mark.parametrize("strategy", ["fsdp"])  # ddp: in process above; one real pair is enough
def test_two_gloo_ranks_train_compiled_and_say_so(data: trainer.DataPaths, tmp_path: Path,
                                                  strategy: str) -> None:
    """The entry point with 2 real ranks (fsdp: rank 1 builds on the meta device and compiles its
    shards' blocks): the ranks end on the same weights, the start-up line names the compile."""
    run = tmp_path / "run"
    proc = run_train("task=causal_lm", "model=gpt", "model.d_model=16", "model.num_heads=2",
                     "model.num_layers=2", "model.compile=true", "model.compile_backend=aot_eager",
                     f"parallelism.strategy={strategy}", f"data.path={data.train}", "data.seq_len=16",
                     "data.batch_size=4", "optim.max_steps=3", *CHEAP, run_dir=run)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert len(set(summary["param_checksum_per_rank"])) == 1 and summary["world_size"] == 2
    assert summary["compile"]["backend"] == "aot_eager" and summary["startup_s"]["compile"] > 0
    logs = "".join(p.read_text() for p in run.rglob("*_log.out"))
    assert ", compile " in logs.split("start-up: ", 1)[1].splitlines()[0]


def test_a_row_model_over_variable_length_samples_compiles_without_a_storm(
        rank: runtime.Runtime, tmp_path: Path) -> None:
    """task=classify with the transformer over 1-6 rows a sample: the row dimension changes from
    batch to batch, torch marks it dynamic at its first change, and the run stays far under the
    recompile limit (it would fail past it)."""
    path = write_rows_dataset(tmp_path / "rows", 48, features=5, classes=3, max_rows=6)
    cfg = TrainConfig(model=TransformerConfig(d_model=16, num_heads=2, num_layers=2, ff_dim=32, compile=True,
                                              compile_backend="aot_eager", compile_recompile_limit=4),
                      data=DataConfig(path=path, num_classes=3, batch_size=4), optim=OptimConfig(max_steps=8),
                      log_every_steps=4, logger=LoggerConfig(tensorboard=False),
                      telemetry=TelemetryConfig(enabled=False))
    summary = train(rank, trainer.DataPaths(train=path, eval=None), tmp_path / "run", cfg)
    assert summary["steps"] == 8 and summary["task"] == "Classify"
    assert summary["compile"]["recompiles"] <= 2


@pytest.mark.parametrize(("scope", "units"), [("blocks", 3), ("model", 1)])
def test_compile_scope_compiles_each_block_or_the_whole_model(scope: str, units: int) -> None:
    """``model.compile_scope=model``: one graph for the whole model, as nanoGPT compiles it."""
    from jobs.models import GPT

    model = GPT(vocab_size=11, seq_len=8, d_model=8, num_heads=2, num_layers=3)
    _, spec = compiling.split({"compile": True, "compile_scope": scope, "compile_backend": "eager"})
    assert compiling.compile_in_place(model, spec, []) == units
    compiled = [m for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert compiled == ([model] if scope == "model" else list(model.blocks))


@pytest.mark.parametrize("optimize_ddp", [True, False])
def test_compile_optimize_ddp_sets_dynamos_ddp_optimizer_before_the_compile(optimize_ddp: bool) -> None:
    from torch._dynamo import config as dynamo_config

    before = dynamo_config.optimize_ddp
    try:
        _, spec = compiling.split({"compile": True, "compile_optimize_ddp": optimize_ddp})
        compiling.compile_in_place(torch.nn.Linear(2, 2), spec, [])
        assert dynamo_config.optimize_ddp is optimize_ddp
    finally:
        dynamo_config.optimize_ddp = before


def test_a_whole_model_compile_under_fsdp_and_a_bad_scope_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"model.compile_scope='model' is invalid: "
                                          r"parallelism.strategy=fsdp all-gathers each block .* "
                                          r"\(try model.compile_scope=blocks, or "
                                          r"parallelism.strategy=ddp\)"):
        TrainConfig(model=GptConfig(compile=True, compile_scope="model"), task=CausalLmTaskConfig(),
                    parallelism=ParallelismConfig(strategy="fsdp"))
    TrainConfig(model=GptConfig(compile=True, compile_scope="model"), task=CausalLmTaskConfig())  # ddp: fine
    with pytest.raises(ConfigError, match=r"model.compile_scope='layers' is invalid: choose one of"):
        GptConfig(compile_scope="layers")
