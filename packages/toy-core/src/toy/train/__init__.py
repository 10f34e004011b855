"""Training: the step graphs and loop, optimizer and schedules, data, checkpoints, recipes.

Modules: ``stepgraph`` (the training step's graphs: loss, backward, clipping,
AdamW, accumulation), ``optim`` (AdamW settings, learning-rate schedules),
``data`` (token cache, packing, batches; reading the corpus is ``toy.corpus``), ``instruct``
(instruction-tuning JSONL: text, prompt/completion, chat messages with loss
masks; packed rows), ``bpe`` (training a byte-level BPE tokenizer),
``checkpoint`` (GGUF checkpoints and training state), ``config`` (TOML
configuration, size presets, recipe defaults), ``model`` (a registered
architecture as a training model: parameters, init, config), ``lora`` (LoRA/QLoRA on a frozen
GGUF base; the adapter files are ``toy.adapters``), ``recipes`` (what lora,
full and warm-start runs set up), ``demodata`` (demo data: Python's
documentation topics, a generated chat set), ``steploop`` (the step loop any
training task shares: events, evals, checkpoints, stopping), ``lmrun``
(language-model runs: ``train`` and ``resume``, for every recipe),
``objectives`` (DPO, ORPO, KTO and GRPO losses in the step graph),
``prefdata`` (preference pairs, labelled examples and prompts),
``prefrun`` (the dpo, orpo and kto runs), ``grpo`` and ``rewards`` (GRPO:
rollouts, reward functions). Merging adapters into a model is ``toy.merge``.
"""
