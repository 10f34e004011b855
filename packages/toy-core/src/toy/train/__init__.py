"""Training: the step engine, optimizer and schedules, data, checkpoints, recipes.

Modules: ``engine`` (the training step graph: loss, backward, clipping,
AdamW, accumulation), ``optim`` (AdamW settings, learning-rate schedules),
``data`` (corpus reading, token cache, packing, batches), ``bpe`` (training a
byte-level BPE tokenizer), ``checkpoint`` (GGUF checkpoints and training
state), ``config`` (TOML configuration and size presets), ``llama`` (the
llama family as a training model: parameters, init, config), ``corpus`` (a
small built-in corpus: Python's documentation topics), ``loop`` (the run
loop: events, progress, signals, resume).
"""
