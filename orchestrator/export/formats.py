"""The two formats an export writes into its (temporary) directory, and how each is reloaded.

- ``hf``: a ``save_pretrained`` directory: safetensors, sharded with ``model.safetensors.index.json``
  past ``shard_mb``, ``config.json``, ``generation_config.json`` where the model has one, and the
  tokenizer files when the run's dataset was prepared with a ``tokenizer.json`` (its own, a
  pretrained one's, or a BPE trained by ``jobs.prepare``). A Hugging Face model is written as it
  is; ``model=gpt`` as ``GPT2LMHeadModel`` (``gpt2``); anything else is refused.
- ``safetensors``: ``model.safetensors`` (the full state dict, a tied weight stored once) and
  ``switchyard_config.json``: the model's config and what it took from the dataset (which rebuild
  it), the run's composed config, and the code snapshot's hash.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from orchestrator.export import gpt2
from orchestrator.export.source import ExportError, Source, run_config
from orchestrator.training import resume

SAFETENSORS_FILE = "model.safetensors"
CONFIG_FILE = "switchyard_config.json"


def check_hf(model: nn.Module) -> bool:
    """Whether ``model`` is written as it is (a PreTrainedModel: True) or mapped (model=gpt:
    False); an ExportError naming why transformers cannot represent it otherwise. Converts
    nothing: called before anything is written."""
    try:
        from transformers import PreTrainedModel
    except ImportError as e:
        raise ExportError("--format hf needs transformers: pip install 'switchyard[hf]' (or use "
                          "--format safetensors)") from e
    if isinstance(model, PreTrainedModel):
        return True
    if gpt2.is_gpt(model):
        gpt2.config(model)  # raises, naming what GPT-2 cannot represent
        return False
    raise ExportError(f"--format hf: model {gpt2.class_path(model)} is not a transformers model, and "
                      f"transformers cannot represent it (it can: any PreTrainedModel, and model=gpt as "
                      f"GPT2LMHeadModel); use --format safetensors")


def hf_model(model: nn.Module, eos_id: int | None) -> Any:
    """What ``save_pretrained`` writes for ``model``: itself, or model=gpt's GPT2LMHeadModel."""
    return model if check_hf(model) else gpt2.convert(model, eos_id)


def write_hf(model: nn.Module, out: Path, shard_mb: float, tokenizer: dict[str, Any] | None) -> nn.Module:
    """The directory; returns the model written (what the reload is compared against)."""
    written = hf_model(model, tokenizer["eos_id"] if tokenizer else None)
    written.save_pretrained(out, max_shard_size=max(1, int(shard_mb * 10**6)))  # bytes
    if tokenizer is not None:
        write_tokenizer(tokenizer, out)
    return written


def reload_hf(out: Path, dtype: torch.dtype) -> nn.Module:
    """As a user would: the class ``config.json`` names, ``from_pretrained``, in ``dtype`` (the
    checkpoint model's: fp32 as Switchyard trains, or a pretrained model's own bf16)."""
    import transformers

    names = json.loads((out / "config.json").read_text()).get("architectures") or []
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:  # a model of the user's own class: what AutoModelForCausalLM maps its config to
        cls = transformers.AutoModelForCausalLM
    loaded: nn.Module = cls.from_pretrained(out, dtype=dtype)
    return loaded.eval()


def tokenizer_of(source: Source) -> dict[str, Any] | None:
    """The run's dataset's tokenizer (``jobs.prepare``'s manifest attributes): its
    ``tokenizer.json`` path and EOS id; None for byte tokens or data without a tokenizer."""
    if source.run_dir is None:
        return None
    data = run_config(source.run_dir).get("data") or {}
    path = data.get("path")
    if not isinstance(path, str) or "${" in path:
        return None
    from sharding.format import DatasetError, read_manifest

    try:
        recorded = read_manifest(Path(path).expanduser()).attributes.get("tokenizer")
    except (DatasetError, OSError):
        return None
    if not isinstance(recorded, dict) or not recorded.get("file"):
        return None
    file = Path(path).expanduser() / str(recorded["file"])
    return {"file": str(file), "eos_id": int(recorded["eos_id"]), "kind": recorded.get("kind")} \
        if file.is_file() else None


def write_tokenizer(tokenizer: dict[str, Any], out: Path) -> None:
    """tokenizer.json as the dataset holds it, plus the config AutoTokenizer needs to load it."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    eos = Tokenizer.from_file(tokenizer["file"]).id_to_token(tokenizer["eos_id"])
    fast = PreTrainedTokenizerFast(tokenizer_file=tokenizer["file"], eos_token=eos, bos_token=eos)
    fast.save_pretrained(out)


def write_safetensors(model: nn.Module, source: Source, out: Path) -> None:
    from safetensors.torch import save_model

    save_model(model, str(out / SAFETENSORS_FILE),
               metadata={"format": "pt", "step": str(source.step), "checkpoint_checksum": source.checksum})
    spec, dataset_kwargs = resume.model_of(source.state["compat"])
    config = {"model": spec, "dataset_kwargs": dataset_kwargs, "code_hash": source.code_hash,
              "step": source.step,
              "run_config": run_config(source.run_dir) if source.run_dir is not None else None}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=1, default=str) + "\n")


def reload_safetensors(out: Path, empty: nn.Module) -> nn.Module:
    """``empty`` (the model rebuilt from its config) given the file's weights, as a user would
    with ``safetensors.torch.load_model``, which re-ties what ``save_model`` stored once."""
    from safetensors.torch import load_model

    missing, unexpected = load_model(empty, str(out / SAFETENSORS_FILE), strict=True)
    if missing or unexpected:  # strict raises first; kept for a safetensors that only reports
        raise ExportError(f"{out / SAFETENSORS_FILE} does not fill the model: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}")
    return empty.eval()


def write(fmt: str, model: nn.Module, source: Source, out: Path, shard_mb: float) -> dict[str, Any]:
    """Write ``fmt`` into ``out``; returns what export.json says of the files."""
    if fmt == "hf":
        tokenizer = tokenizer_of(source)
        written = write_hf(model, out, shard_mb, tokenizer)
        return {"class": type(written).__name__, "tokenizer": tokenizer,
                "files": sorted(p.name for p in out.iterdir())}
    write_safetensors(model, source, out)
    return {"class": gpt2.class_path(model), "tokenizer": None,
            "files": sorted(p.name for p in out.iterdir())}
