"""LoRA adapters: the file format and applying adapters to a model.

- ``toy.adapters.file``: adapter GGUFs in llama.cpp's format (``Adapter``,
  ``load_adapter``, ``save_adapter``, ``AdapterError``);
- ``toy.adapters.apply``: parsing ``--lora`` values, checking an adapter
  against a base model, and its A/B tensors on a runtime for the engine.

Layer: above the models (it reads their ``lora_targets``) and below the
engine, training and merging, which all use it (see the layer table in
``docs/concepts/architecture.md``). Training adapters (``toy.train.lora``)
stays in ``toy.train``.
"""

from toy.adapters.apply import (
    AdapterNameError,
    SelectableAdapter,
    adapter_digest,
    check_adapter_name,
    check_lora,
    load_lora,
    lora_context,
    lora_items,
    named_items,
    parse_lora_arg,
    read_adapters,
    read_selectable,
    split_terms,
)
from toy.adapters.file import Adapter, AdapterError, load_adapter, lora_alpha_for_file, save_adapter

__all__ = [
    "Adapter",
    "AdapterError",
    "AdapterNameError",
    "SelectableAdapter",
    "adapter_digest",
    "check_adapter_name",
    "check_lora",
    "load_adapter",
    "load_lora",
    "lora_alpha_for_file",
    "lora_context",
    "lora_items",
    "named_items",
    "parse_lora_arg",
    "read_adapters",
    "read_selectable",
    "save_adapter",
    "split_terms",
]
