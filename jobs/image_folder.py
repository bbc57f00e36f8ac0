"""Images for ``jobs.prepare format=image_folder``: ``DIR/<class>/*``, every format Pillow reads
(``.png``, ``.jpg``, ``.webp``, ``.bmp``, ``.tiff``, ``.gif``, ...) and ``.npy`` arrays. Anything else
in the folder (a ``notes.txt``, a nested folder) is counted and named when the dataset is written,
never skipped silently.

Each image becomes ``x``, channels first as torch expects (``uint8 [C, H, W]``: grayscale C=1,
RGB C=3, RGBA C=4), and ``y``, the int64 index of its class folder in sorted name order. Every
image of a dataset has one shape: the format lets only the leading dimension vary, and a model
takes one input size, so a mismatch is refused naming the file and both shapes (resize first).
A ``.npy`` file is stored as it is (any dtype), a 2-D array as one channel ``[1, H, W]``.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.config import invalid
from sharding.format import DatasetError, describe_array

NAMED_SKIPPED = 5  # entries a note names; the rest are counted
# Pillow modes stored as they are (channels: L 1, LA 2, RGB 3, RGBA 4), and those converted first.
KEPT_MODES = ("L", "LA", "RGB", "RGBA")
CONVERTED_MODES = {"1": "L", "CMYK": "RGB", "YCbCr": "RGB", "LAB": "RGB", "HSV": "RGB"}


@functools.cache
def image_suffixes() -> frozenset[str]:
    """``.npy`` and every suffix Pillow registers a decoder for, but its stubs (``.h5``, ``.grib``,
    ``.wmf``: they decode nothing without a handler of the user's). Listed by hand, the folder's
    ``.webp`` and ``.bmp`` images were skipped without a word."""
    from PIL import Image, ImageFile  # deferred: only image inputs need Pillow

    Image.init()
    stub = {name for name, (factory, _) in Image.OPEN.items()
            if inspect.isclass(factory) and issubclass(factory, ImageFile.StubImageFile)}
    return frozenset({".npy"} | {suffix for suffix, name in Image.registered_extensions().items()
                                 if name in Image.OPEN and name not in stub})


def is_image(path: Path) -> bool:
    return path.suffix.lower() in image_suffixes() and path.is_file()


def looks_like_image_folder(path: Path) -> bool:
    """A directory with no .npy files of its own whose first class folder holds an image: what
    format=auto takes for an image folder (a .npy directory holds its samples at the top)."""
    if not path.is_dir() or any(p.suffix == ".npy" and p.is_file() for p in path.iterdir()):
        return False
    folders = class_folders(path)
    return bool(folders) and any(is_image(p) for p in folders[0].iterdir())


def class_folders(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


def list_images(path: Path) -> tuple[list[str], list[tuple[Path, int]], list[Path]]:
    """(class names, (file, label) per image, what is not read): classes in sorted order, files
    sorted by name. A class folder without images is refused (dropping it would shift every later
    label); anything else the folder holds (a file that is no image, a nested or hidden folder, a
    file beside the class folders) is returned, for the user to be told."""
    folders = class_folders(path)
    if not folders:
        raise invalid("input", str(path), "has no class folders (DIR/<class>/*.png)",
                      "input=/path/to/DIR holding one folder per class")
    items: list[tuple[Path, int]] = []
    skipped = sorted(set(path.iterdir()) - set(folders))
    for label, folder in enumerate(folders):
        entries = sorted(folder.iterdir())
        files = [p for p in entries if is_image(p)]
        skipped += sorted(set(entries) - set(files))
        if not files:
            raise invalid("input", str(path), f"class folder {folder.name!r} has no images "
                          f"(files Pillow reads, or .npy){skipped_text(path, skipped, ': it holds ')}",
                          f"add its images, or move {folder} out")
        items += [(f, label) for f in files]
    return [f.name for f in folders], items, skipped


def skipped_text(root: Path, skipped: list[Path], lead: str) -> str:
    """``lead`` and the first entries of ``skipped``, relative to ``root``; empty for none."""
    if not skipped:
        return ""
    named = ", ".join(str(p.relative_to(root)) + ("/" if p.is_dir() else "") for p in skipped[:NAMED_SKIPPED])
    more = f" and {len(skipped) - NAMED_SKIPPED} more" if len(skipped) > NAMED_SKIPPED else ""
    return f"{lead}{named}{more}"


def skipped_note(root: Path, skipped: list[Path]) -> str:
    """The line jobs.prepare prints after the dataset is written: what it did not read."""
    return skipped_text(root, skipped, f"skipped {len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'} "
                        f"of {root} that {'is' if len(skipped) == 1 else 'are'} not an image in a "
                        f"class folder (Pillow's formats, or .npy): ")


def load_image(path: Path) -> np.ndarray:
    """One image as ``[C, H, W]``; runs in a worker process, so its error must pickle (a plain
    message does)."""
    if path.suffix.lower() == ".npy":
        return _load_npy_image(path)
    from PIL import Image, UnidentifiedImageError  # deferred: only image inputs need Pillow

    try:
        with Image.open(path) as image:
            image.load()
            return image_array(image, str(path))
    except (OSError, UnidentifiedImageError) as e:
        raise DatasetError(f"{path}: not a readable image ({e}); fix or remove it") from e


def image_array(image: Any, where: str) -> np.ndarray:
    """A loaded PIL image as uint8 ``[C, H, W]``: a palette as its colours, 16-bit or float pixels
    refused (``where`` names it); the image folder's and a Hugging Face dataset's image columns."""
    mode = _mode_for(image.mode, "transparency" in image.info, where)
    pixels = np.asarray(image.convert(mode) if mode != image.mode else image)
    if pixels.ndim == 2:  # [H, W]: one channel
        return np.ascontiguousarray(pixels[None])
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))  # [H, W, C] -> [C, H, W]


def _mode_for(mode: str, has_transparency: bool, path: Path | str) -> str:
    if mode in KEPT_MODES:
        return mode
    if mode == "P":  # a palette: its colours, with alpha where the palette has transparency
        return "RGBA" if has_transparency else "RGB"
    if mode in CONVERTED_MODES:
        return CONVERTED_MODES[mode]
    raise DatasetError(f"{path}: Pillow mode {mode!r} (16-bit or float pixels) does not fit "
                       f"uint8 without losing values: save it as a .npy array [C, H, W] instead")


def _load_npy_image(path: Path) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:  # EOFError: an empty or truncated file
        raise DatasetError(f"{path}: not a readable .npy array ({e}); fix or remove it") from e
    if array.ndim == 2:
        return array[None]  # [1, H, W]
    if array.ndim != 3:
        raise DatasetError(f"{path}: holds {describe_array(array)}, expected an image [C, H, W] "
                           f"or [H, W]")
    return array


def check_same_shape(image: np.ndarray, first: np.ndarray, path: Path, first_path: Path) -> None:
    """Every image like the first: the format stores [*, H, W] with H and W fixed, and a model
    takes one input size."""
    if image.shape != first.shape or image.dtype != first.dtype:
        raise DatasetError(f"{path} is {describe_array(image)} but {first_path} (the first image) "
                           f"is {describe_array(first)}: every image of a dataset needs one shape "
                           f"and dtype; resize or convert it (or move it out)")
