"""jobs.prepare format=image_folder (DIR/<class>/*.png|jpg|npy -> x uint8 [C, H, W], y int64) and
labels=FILE.npy for a .npy directory, with images made by Pillow here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jobs.prepare import detect_format, prepare
from orchestrator.config import ConfigError, PrepareConfig
from sharding import DatasetError, open_dataset, verify


def _config(input_path: Path, output: Path, **kwargs: object) -> PrepareConfig:
    return PrepareConfig(input=str(input_path), output=str(output), **kwargs)  # type: ignore[arg-type]


def _save(path: Path, pixels: np.ndarray) -> np.ndarray:
    """Save [H, W] or [H, W, C] uint8 pixels; return them channels first, as the dataset holds them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


def _folder(root: Path, channels: int, num_per_class: int = 3) -> list[tuple[np.ndarray, int]]:
    """Two classes, 'dog' written first so sorting is what puts 'cat' at label 0."""
    rng = np.random.default_rng(channels)
    expected: dict[str, list[np.ndarray]] = {}
    for name in ("dog", "cat"):
        shape = (8, 8) if channels == 1 else (8, 8, channels)
        expected[name] = [_save(root / name / f"img{k}.png",
                                rng.integers(0, 256, shape, dtype=np.uint8))
                          for k in range(num_per_class)]
    return [(x, 0) for x in expected["cat"]] + [(x, 1) for x in expected["dog"]]


def _assert_holds(path: Path, expected: list[tuple[np.ndarray, int]]) -> None:
    ds = open_dataset(path)
    assert len(ds) == len(expected)
    for i, (x, y) in enumerate(expected):
        sample = ds.sample(i)
        assert sample["x"].dtype == np.uint8 and sample["x"].shape == x.shape
        np.testing.assert_array_equal(sample["x"], x)
        assert sample["y"].dtype == np.int64 and int(sample["y"]) == y
    assert verify(path) == []


@pytest.mark.parametrize(("channels", "num_workers"), [(3, 1), (1, 2), (4, 1)])
def test_an_image_folder_round_trips_channels_first_with_sorted_class_labels(tmp_path, channels,
                                                                              num_workers):
    expected = _folder(tmp_path / "images", channels)
    assert detect_format(str(tmp_path / "images"), "auto")[0] == "image_folder"
    prepare(_config(tmp_path / "images", tmp_path / "out", num_workers=num_workers))
    _assert_holds(tmp_path / "out", expected)
    ds = open_dataset(tmp_path / "out")
    assert ds.attributes == {"classes": ["cat", "dog"]}
    assert expected[0][0].shape == (channels, 8, 8)
    assert ds.value_range("y") == (0, 1)  # what jobs.train checks data.num_classes against


def test_jpeg_and_npy_images_sit_beside_png(tmp_path):
    root = tmp_path / "images"
    png = _save(root / "a" / "1.png", np.full((4, 5, 3), 7, np.uint8))
    jpg = _save(root / "a" / "2.JPG", np.full((4, 5, 3), 200, np.uint8))  # any case of suffix
    npy = np.arange(60, dtype=np.uint8).reshape(3, 4, 5)
    (root / "b").mkdir()
    np.save(root / "b" / "1.npy", npy)
    (root / "b" / "notes.txt").write_text("ignored: not an image")
    prepare(_config(root, tmp_path / "out", format="image_folder"))
    ds = open_dataset(tmp_path / "out")
    np.testing.assert_array_equal(ds.sample(0)["x"], png)
    assert np.abs(ds.sample(1)["x"].astype(int) - jpg).max() <= 2  # jpeg is lossy
    np.testing.assert_array_equal(ds.sample(2)["x"], npy)
    assert [int(ds.sample(i)["y"]) for i in range(3)] == [0, 0, 1]


def test_images_of_another_shape_are_refused_naming_the_file_and_both_shapes(tmp_path):
    root = tmp_path / "images"
    _folder(root, 3)
    _save(root / "dog" / "img9.png", np.zeros((8, 8), np.uint8))  # grayscale among RGB
    with pytest.raises(DatasetError, match=r"dog/img9.png is uint8\[1, 8, 8\] but .*cat/img0.png "
                                           r"\(the first image\) is uint8\[3, 8, 8\]"):
        prepare(_config(root, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_an_empty_class_folder_is_refused_before_output(tmp_path):
    root = tmp_path / "images"
    _folder(root, 3)
    (root / "emu").mkdir()
    with pytest.raises(ConfigError, match=r"class folder 'emu' has no images \(files Pillow reads, or "
                                          r"\.npy\) \(try add its images"):
        prepare(_config(root, tmp_path / "out", format="image_folder"))
    (root / "emu" / "emu.txt").write_text("not an image")
    with pytest.raises(ConfigError, match=r"class folder 'emu' has no images .*: it holds emu/emu.txt "):
        prepare(_config(root, tmp_path / "out", format="image_folder"))
    assert not (tmp_path / "out").exists()


def test_every_format_pillow_reads_is_prepared_and_the_rest_is_named(tmp_path):
    """Issue 34: 24 images on disk, 'wrote 4 samples', and no word of the .webp and .bmp skipped."""
    root, rng = tmp_path / "images", np.random.default_rng(0)
    expected = []
    for label, name in enumerate(("cat", "dog")):
        for suffix in (".png", ".webp", ".bmp", ".tiff", ".ppm", ".tga", ".gif"):
            pixels = rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)
            path = root / name / f"img{suffix}"
            path.parent.mkdir(parents=True, exist_ok=True)
            if suffix == ".gif":  # a palette of its own 30 colours: decoded exactly, as RGB
                Image.fromarray(pixels).quantize(256).save(path)
                pixels = np.asarray(Image.open(path).convert("RGB"))
            else:
                Image.fromarray(pixels).save(path, **({"lossless": True} if suffix == ".webp" else {}))
            expected.append((path, pixels.transpose(2, 0, 1), label))
    (root / "cat" / "notes.txt").write_text("a note")
    (root / "dog" / "more").mkdir()
    (root / "README.md").write_text("a readme")
    result = prepare(_config(root, tmp_path / "out"))
    assert result.num_samples == len(expected) == 14
    _assert_holds(tmp_path / "out", [(x, y) for _, x, y in sorted(expected, key=lambda e: (e[2], e[0]))])
    assert result.note == (f"skipped 3 entries of {root} that are not an image in a class folder "
                           f"(Pillow's formats, or .npy): README.md, cat/notes.txt, dog/more/")
    assert str(result).endswith(result.note)


def test_a_file_that_is_no_image_is_named(tmp_path):
    root = tmp_path / "images"
    _folder(root, 3)
    (root / "cat" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(DatasetError, match=r"cat/broken.png: not a readable image"):
        prepare(_config(root, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_16_bit_image_is_refused_instead_of_truncated(tmp_path):
    root = tmp_path / "images"
    root.joinpath("a").mkdir(parents=True)
    Image.fromarray(np.full((4, 4), 40000, np.uint16)).save(root / "a" / "deep.png")
    with pytest.raises(DatasetError, match=r"deep.png: Pillow mode 'I;16'.*\.npy"):
        prepare(_config(root, tmp_path / "out"))


# ------------------------------------------------------------------------------------------------
# labels=FILE.npy for a directory of .npy files


def _npy_dir(root: Path, num: int) -> list[np.ndarray]:
    root.mkdir()
    arrays = [np.full((k % 3, 2), k, np.float32) for k in range(num)]
    for k in reversed(range(num)):  # written out of order: the labels follow sorted names
        np.save(root / f"s{k:02d}.npy", arrays[k])
    return arrays


def test_labels_npy_round_trips_as_y_in_sorted_file_order(tmp_path):
    arrays = _npy_dir(tmp_path / "npy", 12)
    labels = np.arange(12, dtype=np.int32) % 5
    np.save(tmp_path / "labels.npy", labels)
    prepare(_config(tmp_path / "npy", tmp_path / "out", labels=str(tmp_path / "labels.npy")))
    ds = open_dataset(tmp_path / "out")
    for k, a in enumerate(arrays):
        np.testing.assert_array_equal(ds.sample(k)["x"], a)
        assert ds.sample(k)["y"].dtype == np.int64 and int(ds.sample(k)["y"]) == labels[k]
    assert ds.value_range("y") == (0, 4)


def test_float_labels_are_stored_as_float32_targets(tmp_path):
    _npy_dir(tmp_path / "npy", 3)
    np.save(tmp_path / "t.npy", np.array([0.5, -1.25, 3.0]))
    prepare(_config(tmp_path / "npy", tmp_path / "out", labels=str(tmp_path / "t.npy")))
    ds = open_dataset(tmp_path / "out")
    assert [ds.sample(k)["y"].item() for k in range(3)] == [0.5, -1.25, 3.0]
    assert ds.schema["y"].dtype == "float32"


def test_a_labels_length_mismatch_is_refused_naming_both_counts(tmp_path):
    _npy_dir(tmp_path / "npy", 12)
    np.save(tmp_path / "labels.npy", np.zeros(11, np.int64))
    with pytest.raises(ConfigError, match=r"labels=.*labels.npy.*holds 11 labels for the 12 .npy "
                                          r"files"):
        prepare(_config(tmp_path / "npy", tmp_path / "out", labels=str(tmp_path / "labels.npy")))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("labels", "message"), [
    (np.zeros((3, 2), np.int64), r"holds int64\[3, 2\], expected a 1-D"),
    (np.array(["a", "b", "c"]), r"expected a 1-D integer"),
])
def test_labels_that_are_not_a_1d_number_array_are_refused(tmp_path, labels, message):
    _npy_dir(tmp_path / "npy", 3)
    np.save(tmp_path / "labels.npy", labels)
    with pytest.raises(ConfigError, match=message):
        prepare(_config(tmp_path / "npy", tmp_path / "out", labels=str(tmp_path / "labels.npy")))


def test_labels_on_another_input_or_with_field_y_are_refused(tmp_path):
    _folder(tmp_path / "images", 3)
    np.save(tmp_path / "labels.npy", np.zeros(6, np.int64))
    with pytest.raises(ConfigError, match=r"labels=.* is only read for a directory of .npy "
                                          r"files.*class folders"):
        prepare(_config(tmp_path / "images", tmp_path / "out", labels=str(tmp_path / "labels.npy")))
    _npy_dir(tmp_path / "npy", 6)
    with pytest.raises(ConfigError, match=r"field='y' is invalid: is the labels' field"):
        prepare(_config(tmp_path / "npy", tmp_path / "out", labels=str(tmp_path / "labels.npy"),
                        field="y"))
