"""An unmodified Hugging Face ``Trainer`` script as every rank of ``switchyard run`` (docs/your-code.md).

    switchyard run parallelism.procs_per_node=2 -- python docs/recipes/hf_trainer.py --max-steps 20

Nothing here knows Switchyard: the Trainer reads torchrun's variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``) that ``switchyard run`` sets on every rank, locally and on SLURM,
and starts its own process group (gloo on CPU, NCCL on GPUs). Its output goes into the run directory
(``SWITCHYARD_RUN_DIR``) when run there.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class RandomTokens(torch.utils.data.Dataset):
    """Stand-in data, the same on every rank: the Trainer's sampler gives each rank its part."""

    def __init__(self, samples: int, seq_len: int, vocab_size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab_size, (samples, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--output-dir", default=os.path.join(os.environ.get("SWITCHYARD_RUN_DIR", "."), "hf"))
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    training = TrainingArguments(output_dir=args.output_dir, per_device_train_batch_size=4,
                                 max_steps=args.max_steps, logging_steps=1, save_strategy="no",
                                 report_to=[], seed=0, use_cpu=not gpu, ddp_backend=None if gpu else "gloo")
    result = Trainer(model=model, args=training, train_dataset=RandomTokens(64, 16, 64)).train()
    print(f"rank {training.process_index}/{training.world_size}: {result.global_step} steps, "
          f"train loss {result.training_loss:.6f}", flush=True)


if __name__ == "__main__":
    main()
