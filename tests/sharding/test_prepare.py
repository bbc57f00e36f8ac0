"""jobs.prepare: three input formats, by function call and as a real `python -m` subprocess."""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module

from jobs.prepare import detect_format, parallel_map, prepare, to_config
from orchestrator.config import ConfigError, PrepareConfig
from sharding import DatasetError, SchemaMismatchError, open_dataset, verify

MEGATRON_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5,
                  np.float64: 6, np.float32: 7, np.uint16: 8}


def write_megatron(prefix: Path, sequences: list[np.ndarray], dtype: type[np.generic]) -> None:
    """A tiny writer of Megatron-LM's MMapIndexedDataset layout, from its documented format."""
    item = np.dtype(dtype).itemsize
    lengths = np.array([len(s) for s in sequences], dtype="<i4")
    pointers = np.zeros(len(sequences), dtype="<i8")
    pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64) * item)
    documents = np.arange(len(sequences) + 1, dtype="<i8")  # one document per sequence
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, MEGATRON_CODES[dtype],
                                                  len(sequences), len(documents)))
        f.write(lengths.tobytes() + pointers.tobytes() + documents.tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        for s in sequences:
            f.write(np.asarray(s, dtype=np.dtype(dtype).newbyteorder("<")).tobytes())


def _config(input_path: Path | str, output: Path, **kwargs: object) -> PrepareConfig:
    return PrepareConfig(input=str(input_path), output=str(output), **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def npy_dir(tmp_path: Path) -> tuple[Path, list[np.ndarray]]:
    """30 .npy files written in shuffled order; sorted by name they are s000, s001, ..."""
    directory = tmp_path / "npy"
    directory.mkdir()
    rng = np.random.default_rng(0)
    arrays = [rng.random((i % 5, 3)).astype(np.float32) for i in range(30)]
    for i in rng.permutation(30):
        np.save(directory / f"s{i:03d}.npy", arrays[i])
    (directory / "README.txt").write_text("not a sample")  # ignored: not .npy
    return directory, arrays


def _assert_dataset_holds(path: Path, arrays: list[np.ndarray], field: str = "x") -> None:
    ds = open_dataset(path)
    assert len(ds) == len(arrays)
    for i, expected in enumerate(arrays):
        got = ds.sample(i)[field]
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)
    assert verify(path) == []


@pytest.mark.parametrize("num_workers", [1, 2])
def test_npy_dir_in_name_order(npy_dir, tmp_path, num_workers):
    directory, arrays = npy_dir
    result = prepare(_config(directory, tmp_path / "out", num_workers=num_workers,
                             shard_bytes=200))
    _assert_dataset_holds(tmp_path / "out", arrays)
    assert result.num_samples == 30 and result.num_shards == len(
        open_dataset(tmp_path / "out").shard_counts) > 1
    assert result.fingerprint == open_dataset(tmp_path / "out").fingerprint


def test_npy_dir_with_a_mismatched_file_names_it_and_publishes_nothing(npy_dir, tmp_path):
    directory, _ = npy_dir
    np.save(directory / "s017.npy", np.zeros((2, 4), np.float32))  # 4 columns, not 3
    with pytest.raises(SchemaMismatchError, match=r"sample 17, field 'x'") as info:
        prepare(_config(directory, tmp_path / "out", num_workers=2))
    assert any("s017.npy" in note for note in info.value.__notes__)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["npy"]  # no temp directory left


def test_pt_list_of_tensors(tmp_path):
    tensors = [torch.arange(n, dtype=torch.int64) for n in (3, 0, 5)]
    torch.save(tensors, tmp_path / "data.pt")
    prepare(_config(tmp_path / "data.pt", tmp_path / "out", field="tokens"))
    _assert_dataset_holds(tmp_path / "out", [t.numpy() for t in tensors], field="tokens")


def test_pt_list_of_dicts(tmp_path):
    items = [{"x": torch.randn(n, 2), "label": torch.tensor(n)} for n in (1, 4, 0)]
    torch.save(items, tmp_path / "data.pt")
    prepare(_config(tmp_path / "data.pt", tmp_path / "out"))
    ds = open_dataset(tmp_path / "out")
    assert list(ds.schema) == ["x", "label"]
    for i, item in enumerate(items):
        np.testing.assert_array_equal(ds.sample(i)["x"], item["x"].numpy())
        assert ds.sample(i)["label"] == item["label"].item()


@pytest.mark.parametrize(("content", "message"), [
    ({"x": torch.zeros(2)}, "holds a dict"),
    ([], "holds an empty list"),
    ([torch.zeros(2), 3], "item 1 is a int"),
    ([{"x": torch.zeros(2)}, {"x": [1, 2]}], "item 1 is a dict"),
    (torch.zeros(3), "holds a Tensor"),
])
def test_pt_holding_something_else_fails_before_output(tmp_path, content, message):
    torch.save(content, tmp_path / "data.pt")
    with pytest.raises(ConfigError, match=f"data.pt.*{message}"):
        prepare(_config(tmp_path / "data.pt", tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.pt"]


def test_pt_that_is_not_a_torch_file(tmp_path):
    (tmp_path / "data.pt").write_bytes(b"definitely not a zip or a pickle")
    with pytest.raises(ConfigError, match=r"cannot be loaded with torch\.load"):
        prepare(_config(tmp_path / "data.pt", tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_pt_bfloat16_is_refused_and_nothing_published(tmp_path):
    torch.save([torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)], tmp_path / "data.pt")
    with pytest.raises(DatasetError, match=r"sample 1, field 'x': bfloat16 has no numpy dtype"):
        prepare(_config(tmp_path / "data.pt", tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.pt"]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.float32, np.uint8])
def test_megatron_indexed_dataset(tmp_path, dtype):
    rng = np.random.default_rng(1)
    sequences = [(rng.random(n) * 100).astype(dtype) for n in (5, 0, 17, 1, 9)]
    write_megatron(tmp_path / "corpus_text_document", sequences, dtype)
    prepare(_config(tmp_path / "corpus_text_document", tmp_path / "out", shard_bytes=160))
    _assert_dataset_holds(tmp_path / "out", sequences)


def test_megatron_input_may_name_the_prefix_or_either_file(tmp_path):
    write_megatron(tmp_path / "c.v2", [np.arange(3, dtype=np.int32)], np.int32)
    for given in ("c.v2", "c.v2.bin", "c.v2.idx"):
        assert detect_format(str(tmp_path / given), "auto") == ("megatron", tmp_path / "c.v2")


@pytest.mark.parametrize(("damage", "message"), [
    (lambda b: b"XXIDIDX\x00\x00" + b[9:], "has magic"),
    (lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], "version 2"),
    (lambda b: b[:17] + bytes([9]) + b[18:], "dtype code 9"),
    (lambda b: b[:40], "bytes for 3 sequences"),
])
def test_bad_megatron_index_fails_before_output(tmp_path, damage, message):
    write_megatron(tmp_path / "m", [np.arange(n, dtype=np.int32) for n in (1, 2, 3)], np.int32)
    idx = tmp_path / "m.idx"
    idx.write_bytes(damage(idx.read_bytes()))
    with pytest.raises(ConfigError, match=message):
        prepare(_config(tmp_path / "m", tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_megatron_pointer_past_the_bin_fails_before_output(tmp_path):
    write_megatron(tmp_path / "m", [np.arange(n, dtype=np.int32) for n in (4, 4)], np.int32)
    with open(tmp_path / "m.bin", "r+b") as f:
        f.truncate(20)
    with pytest.raises(ConfigError, match=r"sequence 1 .* lies outside the 20-byte \.bin"):
        prepare(_config(tmp_path / "m", tmp_path / "out"))


@pytest.mark.parametrize(("make", "fmt", "message"), [
    (lambda p: None, "auto", "does not exist"),
    (lambda p: p.write_text("hello"), "auto", "is not a recognized input"),
    (lambda p: p.mkdir(), "auto", "directory without .npy files"),
    (lambda p: p.mkdir(), "pt", "is not a pt input"),
])
def test_bad_input_fails_before_output(tmp_path, make, fmt, message):
    make(tmp_path / "input")
    with pytest.raises(ConfigError, match=f"input=.*{message}"):
        prepare(_config(tmp_path / "input", tmp_path / "out", format=fmt))
    assert not (tmp_path / "out").exists()


def test_existing_output_fails_before_reading_input(npy_dir, tmp_path):
    directory, _ = npy_dir
    (tmp_path / "out").mkdir()
    with pytest.raises(DatasetError, match="already exists"):
        prepare(_config(directory, tmp_path / "out"))


def test_config_checks_values():
    with pytest.raises(ConfigError, match=r"format='zip' is invalid.*try format=auto"):
        PrepareConfig(input="a", output="b", format="zip")
    with pytest.raises(ConfigError, match="shard_bytes=0 is invalid"):
        PrepareConfig(input="a", output="b", shard_bytes=0)
    with pytest.raises(ConfigError, match="num_workers=-1 is invalid"):
        PrepareConfig(input="a", output="b", num_workers=-1)


def test_hydra_composes_prepare_and_keeps_out_of_the_cwd():
    with initialize_config_module(config_module="conf", version_base="1.3"):
        overrides = ["input=in", "output=out", "shard_bytes=1024"]
        hydra_cfg = compose("prepare", overrides=overrides, return_hydra_config=True).hydra
        assert hydra_cfg.run.dir == "." and hydra_cfg.output_subdir is None
        assert hydra_cfg.job.chdir is False
        config = to_config(compose("prepare", overrides=overrides))
        assert isinstance(config, PrepareConfig) and config.shard_bytes == 1024
        with pytest.raises(ConfigError, match="input is required"):
            to_config(compose("prepare", overrides=["output=out"]))


# ------------------------------------------------------------------------------------------------
# As the user runs it: `python -m jobs.prepare input=... output=...`, from an empty directory


def _run_prepare(cwd: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    cwd.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "jobs.prepare", *overrides], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def _inputs(tmp_path: Path) -> dict[str, tuple[Path, list[np.ndarray]]]:
    arrays = [np.arange(n, dtype=np.int32) for n in (2, 0, 7, 3)]
    (tmp_path / "npy").mkdir()
    for i, a in enumerate(arrays):
        np.save(tmp_path / "npy" / f"{i:02d}.npy", a)
    torch.save([torch.from_numpy(a) for a in arrays], tmp_path / "list.pt")
    write_megatron(tmp_path / "mega", arrays, np.int32)
    return {"npy": (tmp_path / "npy", arrays), "pt": (tmp_path / "list.pt", arrays),
            "megatron": (tmp_path / "mega", arrays)}


def test_all_three_formats_as_a_subprocess(tmp_path):
    cwd = tmp_path / "cwd"
    for name, (source, arrays) in _inputs(tmp_path).items():
        out = tmp_path / f"out_{name}"
        proc = _run_prepare(cwd, f"input={source}", f"output={out}", "shard_bytes=32")
        assert proc.returncode == 0, proc.stderr
        assert f"wrote {len(arrays)} samples" in proc.stdout
        assert "samples/s" in proc.stdout and "MB/s" in proc.stdout
        _assert_dataset_holds(out, arrays)
    assert list(cwd.iterdir()) == []  # no outputs/, .hydra/ or prepare.log in the user's cwd


def test_relative_output_is_relative_to_the_cwd(tmp_path):
    source, arrays = _inputs(tmp_path)["npy"]
    proc = _run_prepare(tmp_path / "cwd", f"input={source}", "output=data/ds")
    assert proc.returncode == 0, proc.stderr
    _assert_dataset_holds(tmp_path / "cwd" / "data" / "ds", arrays)


def test_bad_input_as_a_subprocess_fails_with_one_clear_line(tmp_path):
    proc = _run_prepare(tmp_path / "cwd", f"input={tmp_path / 'missing.pt'}",
                        f"output={tmp_path / 'out'}")
    assert proc.returncode == 1
    assert proc.stderr.startswith("jobs.prepare: error: input=")
    assert "missing.pt" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
    assert list((tmp_path / "cwd").iterdir()) == []


@pytest.mark.parametrize("num_workers", [1, 2])
def test_an_empty_npy_file_is_one_error_naming_it_and_publishes_nothing(npy_dir, tmp_path, num_workers):
    """A 0-byte .npy raised numpy's EOFError: a traceback that named no file."""
    directory, _ = npy_dir
    (directory / "s017.npy").write_bytes(b"")
    with pytest.raises(DatasetError, match=r"s017\.npy: not a readable \.npy array \(EOFError"):
        prepare(_config(directory, tmp_path / "out", num_workers=num_workers))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["npy"]  # nothing published, no temp left


@pytest.mark.timeout(120)
def test_a_failed_read_ends_the_pool_under_a_callers_own_sigterm_handler(npy_dir, tmp_path):
    """The suite hung here for 600 s: a process that handles SIGTERM itself (a training loop's stop
    flag, left by an earlier test in the same pytest worker) forked readers that only recorded the
    pool's terminate(), and its join waited forever after a file failed to read."""
    directory, _ = npy_dir
    (directory / "s017.npy").write_bytes(b"")
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        with pytest.raises(DatasetError, match=r"s017\.npy: not a readable \.npy array"):
            prepare(_config(directory, tmp_path / "out", num_workers=2))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["npy"]


@pytest.mark.parametrize("make, kind", [(lambda p: p.mkdir(), "a directory"),
                                        (lambda p: os.mkfifo(p), "a FIFO")])
def test_a_npy_entry_that_is_not_a_file_is_named_not_skipped(npy_dir, tmp_path, make, kind):
    """Skipped, the dataset silently lacked a sample; a FIFO would block its reader forever."""
    directory, _ = npy_dir
    (directory / "s017.npy").unlink()
    make(directory / "s017.npy")
    with pytest.raises(DatasetError, match=rf"s017\.npy: is {kind}, not a \.npy file .*remove it"):
        prepare(_config(directory, tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["npy"]


def _slow_unless_first(item: tuple[Path, int]) -> int:
    """A reader's work: item 0 fails at once; each other one marks its start and its end."""
    marks, number = item
    if number == 0:
        raise DatasetError("item 0: not readable")
    (marks / f"start-{number}").touch()
    time.sleep(0.5)
    (marks / f"end-{number}").touch()
    return number


def test_a_failed_read_lets_the_running_readers_finish_instead_of_killing_them(tmp_path):
    """jobs.prepare hung without a word about once in 80 runs under load (once in a full suite's
    run): multiprocessing.Pool's terminate() SIGTERMed its readers, and one killed while it held
    the result queue's lock left the pool's task thread waiting forever. Now the reads not started
    are cancelled and the running ones end their work: none is killed in the middle of it."""
    with pytest.raises(DatasetError, match="item 0: not readable"), contextlib.ExitStack() as stack:
        for _ in parallel_map(stack, _slow_unless_first, [(tmp_path, i) for i in range(8)], 2, chunksize=1):
            pass
    started = {p.name.split("-")[1] for p in tmp_path.glob("start-*")}
    assert started, "no reader was at work when the error came"
    assert started == {p.name.split("-")[1] for p in tmp_path.glob("end-*")}
    # no read past the look-ahead started: two chunks per reader were queued (items 0-3), and no
    # more after the error
    assert max(int(n) for n in started) < 2 * 2


def _killed_at_three(number: int) -> int:
    if number == 3:
        time.sleep(0.5)  # items 0 and 1 have come back by then: the first chunk missing is 2-3
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer would
    return number


@pytest.mark.timeout(120)  # the Pool version waits forever
def test_a_reader_that_dies_is_one_error_line_not_a_wait(tmp_path):
    """A killed reader's chunk never came back, and multiprocessing.Pool waited for it forever."""
    with pytest.raises(DatasetError, match=r"a reader process ended without a result \(killed, or out of "
                                           r"memory\) before 2 and what follows it were read: nothing"), \
            contextlib.ExitStack() as stack:
        for _ in parallel_map(stack, _killed_at_three, list(range(8)), 2, chunksize=2):
            pass


def test_the_command_prints_an_empty_npy_as_one_error_line(npy_dir, tmp_path):
    directory, _ = npy_dir
    (directory / "s003.npy").write_bytes(b"")
    proc = subprocess.run([sys.executable, "-m", "jobs.prepare", f"input={directory}",
                           f"output={tmp_path / 'out'}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("jobs.prepare: error: ") and "s003.npy: not a readable .npy array" in last
