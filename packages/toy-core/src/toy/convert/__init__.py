"""Conversions between toy's GGUF files and Hugging Face formats.

- ``import_hf(folder, out, type=...)``: a Hugging Face model folder
  (config.json, safetensors, tokenizer.json) to one GGUF file, as llama.cpp's
  converter writes it (``toy.convert.hf_import``);
- ``export_hf(model, folder)``: a GGUF model to a folder transformers loads
  (``toy.convert.hf_export``);
- ``import_peft(folder, base, out)`` / ``export_peft(adapter, out)``: PEFT
  LoRA adapter folders to and from llama.cpp's adapter format
  (``toy.convert.peft``);
- ``SafetensorsFolder``: the safetensors weights of a folder, read one
  tensor at a time (``toy.convert.safetensors_io``).
"""

from toy.convert.hf_common import HFImportError
from toy.convert.hf_export import ExportReport, HFExportError, export_hf
from toy.convert.hf_import import ImportReport, import_hf
from toy.convert.peft import PeftAdapterError, export_peft, import_peft
from toy.convert.safetensors_io import SafetensorsError, SafetensorsFolder

__all__ = [
    "ExportReport",
    "HFExportError",
    "HFImportError",
    "ImportReport",
    "PeftAdapterError",
    "SafetensorsError",
    "SafetensorsFolder",
    "export_hf",
    "export_peft",
    "import_hf",
    "import_peft",
]
