"""What is trained, behind one small interface: the trainer knows no task.

A task says which fields it reads, what it needs of a dataset (checked before submission), what
the model's constructor gets from the dataset, a real example batch, and per-batch sums on the
device: the loss summed over its units (samples, or tokens for a language model) and the count of
units. The trainer divides every micro-batch's loss sum by the task's fixed ``denominator``, so
``k`` accumulated micro-batches give exactly the gradient of one ``k``-times larger batch, and
padding entries (``is_pad``) count nowhere.

The built-ins (``task=classify``, ``causal_lm``, ``regress``) go through the same door as a
user's ``task._target_=my_pkg.MyTask``: a subclass of ``Task`` constructed as
``MyTask(data=DataConfig, **its config keys)``. docs/tasks.md, "Your own task", has a worked example.
``Task`` is an abstract base class: a task without ``forward`` or ``loss_sums`` is refused when it
is built (before submission, naming what is missing), not at its first step on the ranks.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from orchestrator.config import ConfigError, DataConfig, group_dict, import_target
from sharding import ShardedDataset

Batch = dict[str, Tensor]


class Task(abc.ABC):
    """The base of every task. Subclasses define ``forward`` and ``loss_sums`` and override the
    other methods where their defaults do not fit: those fit tasks that read samples (not
    windows) through the padded batch loader."""

    unit = "samples"  # what ``loss_sums``' count counts: the summary reports it per rank

    def __init__(self, data: DataConfig) -> None:
        self.data = data

    # -- the data ---------------------------------------------------------------------------

    def setup(self, ds: ShardedDataset) -> None:  # noqa: B027  (a hook: nothing by default)
        """Called once with the training dataset, before anything else reads it (the submitting
        side and every rank): a task may note what the data is (an input's shape)."""

    def check_dataset(self, key: str, ds: ShardedDataset) -> None:  # noqa: B027  (a hook)
        """Refuse, before submission, a dataset this task cannot train on: a ConfigError naming
        ``key`` (``data.path`` or ``data.eval_path``), the field, its dtype and shape, and a fix."""

    def model_kwargs(self, ds: ShardedDataset) -> dict[str, Any]:
        """What the model's constructor gets from the dataset (sizes, classes, vocabulary)."""
        return {}

    def source(self, ds: ShardedDataset) -> Any:
        """What the loader reads: ``None`` for the padded batches of ``ds``'s samples (the
        default), or a dataset of its own with ``shard_counts`` and ``__getitems__(values)``
        (a language model's token windows)."""
        return None

    def fields(self) -> tuple[str, ...]:
        """The batch fields ``forward`` and the sums read on the device; the rest stay on the host."""
        return ("is_pad",)

    # -- the step: everything on the device, nothing read on the host -----------------------

    @abc.abstractmethod
    def forward(self, model: nn.Module, batch: Batch) -> Tensor:
        """The model's output for one batch (called under autocast where amp is on)."""

    @abc.abstractmethod
    def loss_sums(self, output: Tensor, batch: Batch) -> tuple[Tensor, Tensor]:
        """(sum of the per-unit losses, number of units) of one batch; padding entries excluded.
        Both on the device: reading them on the host would stall the GPU."""

    def denominator(self, batch_size: int) -> float:
        """The most units one micro-batch of ``batch_size`` entries can hold: the loss of a
        micro-batch is its sum divided by this times the number of micro-batches, never by
        the batch's own count (which would weigh short batches up)."""
        return float(batch_size)

    def eval_sums(self, output: Tensor, batch: Batch) -> Tensor:
        """float64 [K] on the device: sums over one eval batch (first the loss sum, then the unit
        count), reduced over all ranks before ``eval_metrics`` reads them."""
        total, count = self.loss_sums(output, batch)
        return torch.stack([total.double(), count.double()])

    def eval_metrics(self, sums: Sequence[float]) -> dict[str, float]:
        """The eval metrics logged and summarised, from the global ``eval_sums``."""
        return {"eval_loss": sums[0] / sums[1]}


def build_task(spec: Any, data: DataConfig) -> Task:
    """The task named by ``spec`` (the ``task`` group: a built-in's dataclass or a user's mapping
    with ``_target_``), constructed with the data config and the group's other keys."""
    kwargs = group_dict(spec)
    target = kwargs.pop("_target_", None)
    cls = import_task(target)
    try:
        task = cls(data=data, **kwargs)
    except TypeError as e:
        raise ConfigError(f"task._target_={target!r} rejects its config: {e} (keys given: "
                          f"{sorted(kwargs) or 'none'}; fix the task.* keys)") from e
    if not isinstance(task, Task):
        raise ConfigError(f"task._target_={target!r} built a {type(task).__name__}, not a "
                          f"orchestrator.training.tasks.Task (subclass Task)")
    return task


def import_task(target: Any) -> type:
    found = import_target("task", target, "task=classify, task=causal_lm, task=regress")
    if not isinstance(found, type):
        raise ConfigError(f"task._target_={target!r} is a {type(found).__name__}, not a Task class")
    if inspect.isabstract(found):  # the constructor would raise a TypeError that reads like a bad key
        missing = ", ".join(sorted(getattr(found, "__abstractmethods__", ())))
        raise ConfigError(f"task._target_={target!r} does not define {missing} (a Task subclass "
                          f"defines forward(model, batch) and loss_sums(output, batch); the built-ins "
                          f"in orchestrator/training/tasks/ are examples)")
    return found


def logits_of(output: Any, task: str, needs: str) -> Tensor:
    """The tensor a task's loss reads from whatever the model returned: a tensor as it is; the
    ``logits`` of a Hugging Face ``ModelOutput``, a dict, a namedtuple or any object with that
    attribute. Anything else (a plain tuple: which item is it?) is a ConfigError naming the type
    returned and what ``task`` needs, raised before submission by the model check."""
    if isinstance(output, Tensor):
        return output
    found = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if isinstance(found, Tensor):
        return found
    returned = type(output).__name__
    if isinstance(output, (tuple, list)):
        returned = f"{returned} of {len(output)}"
    elif found is not None:
        returned = f"{returned} whose logits is a {type(found).__name__}"
    raise ConfigError(f"model returned {returned}; {task} needs {needs} or an output with .logits "
                      f"(return the tensor, or an object or dict with a logits tensor)")


def accepts(model: nn.Module, name: str) -> bool:
    """``model.forward`` names the keyword ``name`` (a Hugging Face model's ``input_ids``)."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a builtin or C forward: called positionally
        return False


def real_mask(batch: Batch) -> Tensor:
    """bool [B]: the entries that are samples, not the sampler's padding."""
    return ~batch["is_pad"]


def describe_fields(ds: ShardedDataset) -> str:
    return ", ".join(f"{n}: {s.dtype}{list(s.shape)}" for n, s in ds.schema.items())


def field_of(key: str, ds: ShardedDataset, option: str, name: str) -> Any:
    """The schema entry of ``name``, or a ConfigError naming the option that chose it."""
    spec = ds.schema.get(name)
    if spec is None:
        raise ConfigError(f"{option}={name!r} is invalid: {key}={str(ds.root)!r} has no such field "
                          f"(fields: {describe_fields(ds)}; try {option}=<one of them>)")
    return spec


def sample_shape(ds: ShardedDataset, name: str) -> tuple[int | None, ...]:
    """A field's shape per sample: the leading size filled in where every sample has the same one
    (the format records every leading size as variable; images ``[3, 32, 32]`` are all 3), None
    where it varies (rows of a ``[rows, features]`` field)."""
    shape = tuple(ds.schema[name].shape)
    stats = ds.field_stats.get(name)
    if shape and shape[0] is None and stats is not None and stats.min_leading == stats.max_leading:
        return (stats.min_leading, *shape[1:])
    return shape


def model_input(x: Tensor) -> Tensor:
    """A model input as the model takes it: uint8 (images) as float in [0, 1], as torchvision's
    ToTensor does; other integers (token ids) and floats as they are."""
    return x.float().div_(255.0) if x.dtype == torch.uint8 else x


def attributes(ds: ShardedDataset) -> Mapping[str, Any]:
    """The dataset's recorded attributes (tokenizer, classes), empty for older datasets."""
    return getattr(ds, "attributes", None) or {}
