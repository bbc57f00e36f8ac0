"""Hugging Face causal LMs under ``task=causal_lm``, as they are: no wrapper (docs/tasks.md).

A new model from a config::

    python -m jobs.train task=causal_lm model=custom model._target_=hf_causal_lm.gpt2 \
        data.path=data/train task.vocab_size=16384 parallelism.strategy=fsdp

Fine-tuning from a directory written by ``save_pretrained`` (no network is needed)::

    python -m jobs.train task=causal_lm model=custom model._target_=hf_causal_lm.pretrained \
        +model.path=/models/my-gpt2 data.path=data/train task.vocab_size=50257

The task passes ``vocab_size`` and ``seq_len`` (from the dataset and ``data.seq_len``); the factory
checks that the model can read them. The task's own loss is the loss: the model's ``labels=`` loss
is never used. Under fsdp the model is sharded per block of the classes it names in
``_no_split_modules`` (``GPT2Block``).
"""

from __future__ import annotations

from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)


def gpt2(vocab_size: int, seq_len: int, n_layer: int = 2, n_embd: int = 32,
         n_head: int = 2) -> PreTrainedModel:
    """A new GPT-2 (no dropout, so ddp and fsdp runs compare exactly)."""
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=n_embd,
                                      n_layer=n_layer, n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def llama(vocab_size: int, seq_len: int, hidden_size: int = 32, num_hidden_layers: int = 2,
          num_attention_heads: int = 4, num_key_value_heads: int = 2) -> PreTrainedModel:
    """A new Llama-style model (RMSNorm, rotary positions, SwiGLU, grouped-query attention)."""
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, max_position_embeddings=seq_len, hidden_size=hidden_size,
        intermediate_size=2 * hidden_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        bos_token_id=0, eos_token_id=0, pad_token_id=None))


def pretrained(path: str, vocab_size: int, seq_len: int) -> PreTrainedModel:
    """The model saved in ``path``, its weights loaded on every rank (see docs/tasks.md for the
    memory this takes). Refused when the dataset's tokens or windows do not fit it."""
    model = AutoModelForCausalLM.from_pretrained(path)
    config = model.config
    if config.vocab_size < vocab_size:
        raise ValueError(f"model.path={path!r} has vocab_size {config.vocab_size} but the dataset's "
                         f"tokens go up to {vocab_size} (prepare the data with this model's tokenizer)")
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if positions is not None and positions < seq_len:
        raise ValueError(f"model.path={path!r} reads at most {positions} positions, data.seq_len is "
                         f"{seq_len} (try data.seq_len={positions})")
    return model
