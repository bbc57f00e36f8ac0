"""Checkpoints as files other tools load: ``switchyard export`` and ``checkpoint.export`` (docs/export.md).

``source`` finds a run's checkpoint and reads its model whole on the host (either format, a DCP
directory tensor by tensor), ``formats`` writes it (a Hugging Face directory, or safetensors and
the composed config), ``gpt2`` maps ``model=gpt`` onto ``GPT2LMHeadModel``, ``verify`` reloads
what was written and compares its logits with the checkpoint's, ``publish`` is the one way an
export appears (a temp directory renamed whole), and ``command`` is the CLI over them.
"""
