"""The hand-written loop Switchyard's GPT step is measured against: nanoGPT's ``train.py`` reduced
to its step, on the same GPT (``jobs.models.GPT``), the same batches and the same maths as
``python -m jobs.train task=causal_lm model=gpt`` on one rank.

What it shares with Switchyard, so that a figure of each compares like with like:
- the weights: ``torch.manual_seed(seed)``, then the model built on the host, as a rank does
  (``runtime.seed_everything``);
- the batches: the token stream of the dataset's documents back to back, window ``w`` its tokens
  ``[w * L, w * L + L + 1)`` (``sharding.windows``), in the order Switchyard's sampler visits them
  for this seed (``window_order``: the one thing taken from Switchyard, the data order);
- the maths: bf16 autocast over the forward, the loss in fp32 (mean cross entropy of every
  position), AdamW with a constant learning rate and no weight decay (Switchyard's defaults), fused
  on CUDA (``foreach`` on the CPU: what Switchyard's ``optim.implementation=auto`` picks there);
- the measure: tokens/s per log window, the loss read on the host only at log steps (nanoGPT's
  "a CPU-GPU sync point").

What it does as nanoGPT does, and Switchyard may not: ``torch.compile(model)`` of the whole model,
compiled lazily at the first step (the first window holds it), each batch sliced from one array
in host memory, pinned and copied ahead (``non_blocking``) by the loop itself, no process group,
no DDP, no sampler, no metrics beyond the loss.

    python bench/reference_gpt.py --data DIR [--batch 8] [--compile] [--profile OUT] > result.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a GPU node's python may have no install of this checkout

from jobs.models import GPT  # noqa: E402
from orchestrator.training import profiling  # noqa: E402
from sharding import open_dataset  # noqa: E402
from sharding.sampler import ShardedSampler, decode_array  # noqa: E402
from sharding.windows import TokenWindows  # noqa: E402


@dataclass(frozen=True)
class Setup:
    data: str
    seq_len: int = 1024
    batch_size: int = 8
    d_model: int = 768
    num_layers: int = 12
    num_heads: int = 12
    lr: float = 3e-3  # optim.lr's default
    steps: int = 100
    log_every: int = 10
    seed: int = 0
    device: str = "cuda"
    amp: str = "bf16"  # bf16 | none
    compile: bool = False
    compile_backend: str = "inductor"  # aot_eager: the CPU tests' (dynamo and autograd, no codegen)
    optimizer: str = "auto"  # auto (fused on CUDA, foreach elsewhere) | fused | foreach
    profile_steps: int = 0  # >0: a trace of this many steps after the first window


def token_stream(data: str) -> np.ndarray:
    """Every document's tokens back to back, int64 [T]: nanoGPT's ``train.bin``, read once into
    host memory."""
    ds = open_dataset(data)
    return np.concatenate([ds.sample(i)["tokens"] for i in range(len(ds))]).astype(np.int64)


def window_order(data: str, seq_len: int, batch_size: int, seed: int, steps: int) -> Iterator[np.ndarray]:
    """Each step's window indices, int64 [<= batch_size]: the sampler's order for ``seed`` on one
    rank, epoch after epoch, an epoch's last batch short as Switchyard's loader hands it out."""
    windows = TokenWindows(open_dataset(data), "tokens", seq_len)
    sampler = ShardedSampler(windows.shard_counts, world_size=1, rank=0, seed=seed, policy="pad",
                             shuffle=True)
    epoch, given = 0, 0
    while True:
        order, is_pad = decode_array(list(sampler))  # int64 [N], bool [N]; one rank: never padded
        if is_pad.any():
            raise ValueError("one rank's epoch holds padding: the reference reads no padded entry")
        for start in range(0, len(order), batch_size):
            if given == steps:
                return
            yield order[start:start + batch_size]
            given += 1
        epoch += 1
        sampler.set_epoch(epoch)


def batches(setup: Setup, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) int64 [B, L] on ``device`` per step, one step ahead: nanoGPT's ``get_batch`` (a slice
    of the host array, pinned, copied without waiting) with the sampler's windows for rows."""
    stream = token_stream(setup.data)
    length = setup.seq_len
    offsets = np.arange(length + 1)  # int64 [L + 1]

    def load(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.from_numpy(stream[windows[:, None] * length + offsets])  # int64 [B, L + 1]
        if device.type == "cuda":
            rows = rows.pin_memory().to(device, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]

    pending = None
    for windows in window_order(setup.data, length, setup.batch_size, setup.seed, setup.steps):
        loaded = load(windows)
        if pending is not None:
            yield pending
        pending = loaded
    if pending is not None:
        yield pending


def build(setup: Setup, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(setup.seed)  # the init Switchyard's rank makes: seeded, built on the host
    model = GPT(vocab_size=vocabulary(setup.data), seq_len=setup.seq_len, d_model=setup.d_model,
                num_heads=setup.num_heads, num_layers=setup.num_layers).to(device)
    kind = setup.optimizer if setup.optimizer != "auto" else "fused" if device.type == "cuda" else "foreach"
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.0,
                                  fused=kind == "fused", foreach=kind == "foreach")
    return model, optimizer


def vocabulary(data: str) -> int:
    tokenizer = open_dataset(data).attributes.get("tokenizer") or {}
    return int(tokenizer["vocab_size"])


def train(setup: Setup, profile_out: Path | None = None) -> dict[str, Any]:
    """Run the loop; per log window: the mean loss and tokens/s; the first step's seconds."""
    device = torch.device(setup.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as Switchyard's memory.tf32=true, and nanoGPT
        torch.backends.cudnn.allow_tf32 = True
    model, optimizer = build(setup, device)
    step_model = torch.compile(model, backend=setup.compile_backend) if setup.compile else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=setup.amp == "bf16")
    losses: list[float] = []
    rates: list[float] = []
    loss_sum = torch.zeros((), device=device)
    tokens = 0
    first_step_s = 0.0
    prof = profiler(setup, device)
    started = time.perf_counter()
    for step, (x, y) in enumerate(batches(setup, device)):
        with autocast:
            logits = step_model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach()  # on the device: no sync
        tokens += x.numel()
        if step == 0 and setup.log_every > 1:
            sync(device)
            first_step_s = time.perf_counter() - started
        if prof is not None:
            prof.step()
        if (step + 1) % setup.log_every == 0 or step + 1 == setup.steps:
            steps_in_window = step % setup.log_every + 1
            losses.append(loss_sum.item() / steps_in_window)  # the window's one host read
            now = time.perf_counter()
            rates.append(tokens / (now - started))
            loss_sum.zero_()
            tokens, started = 0, now
    if prof is not None:
        prof.stop()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"setup": asdict(setup), "losses": losses, "tokens_per_s": rates, "first_step_s": first_step_s,
            "steady_tokens_per_s": steady(rates), "peak_bytes": peak,
            "profile": profile_summary(prof, setup, profile_out)}


def steady(rates: list[float]) -> float:
    """The median window after the first (the first holds the start-up, and a compile): the
    figure gpu_check sets beside Switchyard's, taken the same way on both sides."""
    later = rates[1:] or rates
    return float(statistics.median(later)) if later else 0.0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profiler(setup: Setup, device: torch.device) -> torch.profiler.profile | None:
    """Switchyard's schedule (``profiling.StepProfiler``): after the first window, one warm-up."""
    if setup.profile_steps <= 0:
        return None
    schedule = torch.profiler.schedule(skip_first=setup.log_every, wait=0, warmup=1,
                                       active=setup.profile_steps, repeat=1)
    prof = torch.profiler.profile(activities=profiling.activities(device), schedule=schedule)
    prof.start()
    return prof


def profile_summary(prof: torch.profiler.profile | None, setup: Setup, out: Path | None
                    ) -> dict[str, Any] | None:
    if prof is None:
        return None
    found = profiling.write(prof, out, "reference", setup.profile_steps) if out is not None else \
        profiling.summary(prof, setup.profile_steps)
    return {"ms_per_step_by_class": found["ms_per_step_by_class"], "device": found["device"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a token dataset (bench/corpora.py's byte_corpus)")
    for name, default in (("seq-len", 1024), ("batch", 8), ("d-model", 768), ("layers", 12), ("heads", 12),
                          ("steps", 100), ("log-every", 10), ("seed", 0), ("profile-steps", 5)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--amp", default="bf16", choices=("bf16", "none"))
    parser.add_argument("--compile", action="store_true", help="torch.compile(model), as nanoGPT")
    parser.add_argument("--profile", type=Path, help="write a trace of --profile-steps steps here")
    args = parser.parse_args()
    setup = Setup(data=args.data, seq_len=args.seq_len, batch_size=args.batch, d_model=args.d_model,
                  num_layers=args.layers, num_heads=args.heads, lr=args.lr, steps=args.steps,
                  log_every=args.log_every, seed=args.seed, device=args.device, amp=args.amp,
                  compile=args.compile, profile_steps=args.profile_steps if args.profile else 0)
    print(json.dumps(train(setup, args.profile)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
