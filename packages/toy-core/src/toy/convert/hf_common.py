"""What the Hugging Face import modules share: the error and JSON reading."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toy.errors import BadInputError


class HFImportError(BadInputError):
    """A Hugging Face folder toy cannot import as it is."""


def err(msg: str, field: str, hint: str) -> HFImportError:
    return HFImportError(msg, hint, field=field)


def read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise err(f"{path}: no such file", path.name, f"a Hugging Face model folder has a {what}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise err(f"{path}: not readable JSON ({e})", path.name, f"check the {what}") from None
    if not isinstance(data, dict):
        raise err(f"{path}: not a JSON object", path.name, f"check the {what}")
    return data
