"""Training: the step engine, optimizer and schedules, data, checkpoints, recipes.

Modules: ``engine`` (the training step graph: loss, backward, clipping,
AdamW, accumulation), ``optim`` (AdamW settings, learning-rate schedules),
``data`` (corpus reading, token cache, packing, batches), ``instruct``
(instruction-tuning JSONL: text, prompt/completion, chat messages with loss
masks; packed rows), ``bpe`` (training a byte-level BPE tokenizer),
``checkpoint`` (GGUF checkpoints and training state), ``config`` (TOML
configuration, size presets, recipe defaults), ``llama`` (the llama family as
a training model: parameters, init, config), ``lora`` (LoRA/QLoRA on a frozen
GGUF base), ``adapter`` (LoRA adapter files in llama.cpp's format),
``merge`` (folding adapters into a model), ``recipes`` (what lora, full and
warm-start runs set up), ``corpus`` (built-in data: Python's documentation
topics, a generated chat set), ``loop`` (the run loop: events, progress,
signals, resume).
"""
