"""The model registry (toy.models): architectures are data.

- No module of toy, toy_cli or toy_serve outside ``toy/models/`` imports an
  architecture module (found by parsing every source file's imports, lazy
  imports inside functions included).
- Every registered name resolves to an object with the whole protocol, and
  an unknown architecture is one clear error listing the registered ones.
- The llama family's parameters keep llama.cpp's converter order and kinds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from toy import models
from toy.errors import BadInputError

ROOT = Path(__file__).resolve().parents[3]
SOURCES = [ROOT / "packages" / p / "src" for p in ("toy-core", "toy-cli", "toy-serve")]
ARCH_MODULES = set(models._MODULES.values())
PROTOCOL = (
    "family",
    "names",
    "presets",
    "lora_names",
    "lora_default",
    "config_from_gguf",
    "config_from_metadata",
    "metadata",
    "train_config",
    "forward",
    "params",
    "lora_targets",
    "attention_scale",
    "output_weight",
)


def _imports(path: Path, package: str) -> set[str]:
    """Every module name ``path`` imports (absolute and resolved relative)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}  # from toy.models import llama
    return out


def _modules():
    for src in SOURCES:
        for path in sorted(src.rglob("*.py")):
            rel = path.relative_to(src).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            yield name, path


def test_no_module_outside_models_imports_an_architecture():
    seen, offenders = 0, []
    for name, path in _modules():
        seen += 1
        if name == "toy.models" or name.startswith("toy.models."):
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        bad = sorted(_imports(path, package) & ARCH_MODULES)
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {', '.join(bad)}")
    assert seen > 50  # the walk found the packages
    assert not offenders, "\n".join(offenders)


def test_the_walk_catches_an_offender(tmp_path):
    """The check itself fails on an import it must refuse (lazy and relative forms)."""
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from toy.models.llama import LlamaConfig\n")
    assert _imports(f, "toy.engine") & ARCH_MODULES == {"toy.models.llama"}
    f.write_text("from ..models import gpt2\n")
    assert _imports(f, "toy.engine") & ARCH_MODULES == {"toy.models.gpt2"}


@pytest.mark.parametrize("name", models.registered())
def test_every_registered_architecture_has_the_protocol(name):
    arch = models.get(name)
    missing = [a for a in PROTOCOL if not hasattr(arch, a)]
    assert not missing
    assert name in arch.names
    assert arch.family in models.families()
    from toy.train.config import ModelShape, resolve_shape

    cfg = arch.train_config(resolve_shape(ModelShape(arch=arch.family, preset="tiny")), 32, 16)
    assert models.of(cfg) is arch
    params = arch.params(cfg)
    assert {p.kind for p in params.values()} <= set(models.KINDS)
    assert arch.output_weight(cfg) in params
    targets = arch.lora_targets(cfg)
    # a config's targets are among the family's names (a MoE variant trades the dense gate/up/down for router)
    assert set(targets) <= set(arch.lora_names) and set(arch.lora_default) <= set(targets)
    for t in targets.values():  # every target names a trainable weight of the right shape
        assert params[f"blk.0.{t.stem}.weight"].shape == (t.d_out, t.d_in)


def test_unknown_architecture_is_one_clear_error():
    with pytest.raises(BadInputError) as e:
        models.get("mamba")
    assert "'mamba' is not supported" in str(e.value)
    for name in ("llama", "qwen2", "qwen3", "gpt2"):
        assert name in e.value.hint
    with pytest.raises(BadInputError, match="None"):
        models.config_from_metadata({}, {})


def test_llama_params_order_and_kinds():
    from toy.models.llama import LlamaConfig

    cfg = LlamaConfig(
        n_vocab=10, d_model=8, n_layer=1, n_head=2, n_head_kv=1, head_dim=4, d_ff=12, rms_eps=1e-5,
        rope_base=1e4, rope_dims=4, rope_mode="normal", tied_output=False, qkv_bias=True,
    )  # fmt: skip
    p = models.of(cfg).params(cfg)
    assert list(p)[:4] == ["token_embd.weight", "blk.0.attn_norm.weight", "blk.0.attn_q.weight", "blk.0.attn_q.bias"]
    assert p["blk.0.attn_k.weight"].shape == (4, 8) and p["blk.0.attn_output.weight"].kind == "residual"
    assert p["blk.0.ffn_down.weight"].kind == "residual" and p["blk.0.ffn_gate.weight"].kind == "matrix"
    assert p["output.weight"].shape == (10, 8) and list(p)[-1] == "output.weight"
    assert {i.kind for i in p.values()} <= set(models.KINDS)
