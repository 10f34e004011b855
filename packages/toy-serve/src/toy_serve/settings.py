"""Server settings: one frozen ``Settings`` value holds every knob of ``toy serve``.

``create_app(settings)`` and the ``toy serve`` command both take a
``Settings``; nothing else carries configuration (no module-level state, no
environment variables read behind the caller's back except the ones
``toy.load`` itself honours, such as ``TOY_DEVICE``).

Invariants:

- A ``Settings`` that exists is valid: ``__post_init__`` checks every range
  and raises ``BadInputError`` (the CLI exits 2) naming the field, e.g.
  ``parallel=0 must be >= 1`` (and carrying it as ``field``: ``parallel``).
- It is frozen and hashable, so the app can hold it without defensive copies.
- ``config()`` is what the run bundle records: the API key is never written,
  only whether one is set.

Decisions:

- ``host`` defaults to loopback (127.0.0.1): exposing a server is a choice
  the user makes explicitly (``--host 0.0.0.0``).
- ``ctx`` is the context of ONE sequence (prompt + max_tokens of one
  request); None means the model's context, at most 4096 (``toy.load``'s
  default). The KV cache holds ``parallel`` such sequences.
- ``max_batch`` bounds the jobs one request may create (prompts x n, or
  embedding inputs); the effective bound is ``min(max_batch, max_queue)``
  since a request larger than the queue could never be admitted.
- ``model_alias`` is the id ``/v1/models`` lists; requests may name the
  model by the alias, the file name, the file stem or the path given.
- ``lora`` holds LoRA adapters applied at inference, as (path, scale)
  pairs; ``"PATH[:SCALE]"`` strings (what ``--lora`` takes) are parsed into
  pairs, so a bad scale is refused here. Whether the file exists and fits
  the model is checked when the model loads (``toy serve`` checks it before
  binding the port). ``config()`` writes them as ``{"path", "scale"}``.
- ``adapters`` holds selectable adapters, (name, path, scale): a request
  uses one by naming it (``model: "<alias>:<name>"`` or the ``lora`` field),
  and requests with different adapters (or none) decode in one batch
  (``toy.engine.llm``). ``--lora NAME=PATH[:SCALE]`` adds one (a value whose
  text before ``=`` is a name and that is not an existing file); names are
  1-64 letters, digits, ``_``, ``-`` or ``.``, each once.
- ``adapter_dirs`` (``--adapter-dir``, repeatable): the only folders
  ``POST /v1/adapters`` loads adapter files from (a path must resolve,
  symlinks followed, inside one); none means loading at run time is off.
  ``max_adapters`` (8) bounds the selectable adapters loaded at once through
  the API (start-up ones count, but are never refused). Whether a folder
  exists is not checked here: a missing one simply holds no file.
- ``constraint_timeout`` (10 s) bounds the compile of a request's output
  constraint (``toy.engine.constrain.prepare``; past it, a 400 naming the
  field). The constraint's structural limits are the library's
  (``toy.engine.constrain.ConstraintLimits``).
- Connections (``toy_serve.conn``): request headers must arrive within
  ``header_timeout`` seconds (10) and a body within ``body_timeout`` (30)
  of its headers, else 408 and the connection closes; at most
  ``max_connections`` are open at once (503 beyond). None means the
  descriptor limit minus a reserve, at most 1000 (``connection_limit``
  says what it is); ``config()`` records the value given.
- The prefix cache (``toy.engine.prefix``) gets ``cache_ram`` MB of RAM
  (256; 0 turns it off, the disk tier with it) and, with ``cache_dir``, a
  folder bounded to ``cache_disk`` MB (2048). ``slot_save_path`` is the
  one folder slot save/restore files live in (None: the route answers 501).
- Speculative decoding (``toy.engine.speculative``): ``speculative`` is
  what a request without a ``speculative`` field gets (none); ``draft``
  needs ``draft_model``, loaded at start-up with the same slots and context
  (a request may ask for ``draft`` only when one was loaded). ``draft_max``
  caps the draft tokens per step (None: ngram 8, draft 4).
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from toy.errors import BadInputError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
MAX_PARALLEL = 256
MIN_TIMEOUT = 0.1  # header and body timeouts below this would cut off any real client


def default_max_connections() -> int:
    """The connection cap when none is set: below the descriptor limit (a quarter of it, at least 64,
    stays for the model, logs, the run bundle and refused connections), at most 1000."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 1000
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return 1000
    return max(8, min(1000, soft - max(64, soft // 4)))


def _int(name: str, value: Any, lo: int | None = None, hi: int | None = None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInputError(f"{name}={value!r} must be an integer" + (" or None" if optional else ""), field=name)
    if lo is not None and value < lo:
        raise BadInputError(f"{name}={value} must be >= {lo}", field=name)
    if hi is not None and value > hi:
        raise BadInputError(f"{name}={value} must be <= {hi}", field=name)


def _seconds(name: str, value: Any, lo: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < lo:
        raise BadInputError(f"{name}={value!r} must be a number of seconds >= {lo:g}", field=name)


def _str(name: str, value: Any, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value.strip():
        msg = f"{name}={value!r} must be a non-empty string" + (" or None" if optional else "")
        raise BadInputError(msg, field=name)


def _lora_pairs(value: Any) -> tuple[tuple[str, float], ...]:
    """``lora`` as a tuple of (path, scale): from "PATH[:SCALE]" strings, paths or (path, scale) pairs."""
    if not value:
        return ()
    if isinstance(value, (str, Path)):
        value = (value,)
    out = []
    for item in value:
        if isinstance(item, (str, Path)):
            from toy.adapters import parse_lora_arg

            path, scale = parse_lora_arg(str(item))
        elif isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], (str, Path)):
            path, scale = str(item[0]), item[1]
            if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
                raise BadInputError(f"lora: the scale {scale!r} of {path} must be a finite number")
        else:
            raise BadInputError(f"lora={item!r} must be 'PATH[:SCALE]' or a (path, scale) pair")
        _str("lora", path)
        out.append((path, float(scale)))
    return tuple(out)


ADAPTER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def named_spec(text: str) -> bool:
    """Whether a ``--lora`` value is ``NAME=PATH[:SCALE]`` (a selectable adapter) rather than a path."""
    head, sep, _ = str(text).partition("=")
    return bool(sep) and bool(ADAPTER_NAME.fullmatch(head)) and not Path(text).exists()


def _named_adapters(value: Any) -> tuple[tuple[str, str, float], ...]:
    """``adapters`` as (name, path, scale): from "NAME=PATH[:SCALE]" strings or (name, path, scale) triples."""
    out: list[tuple[str, str, float]] = []
    for item in value or ():
        if isinstance(item, str):
            if not named_spec(item):
                raise BadInputError(f"adapters: {item!r} is not NAME=PATH[:SCALE]")
            name, _, rest = item.partition("=")
            ((path, scale),) = _lora_pairs([rest])
        elif isinstance(item, (tuple, list)) and len(item) == 3:
            name = item[0]
            ((path, scale),) = _lora_pairs([(item[1], item[2])])
        else:
            raise BadInputError(f"adapters: {item!r} must be 'NAME=PATH[:SCALE]' or (name, path, scale)")
        if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
            raise BadInputError(f"adapter name {name!r}: use 1-64 letters, digits, '_', '-' or '.'")
        if any(n == name for n, _, _ in out):
            raise BadInputError(f"the adapter name {name!r} is given twice")
        out.append((name, path, scale))
    return tuple(out)


@dataclass(frozen=True)
class Settings:
    """Everything ``toy serve`` can be told. See the module docstring for the decisions."""

    model: str  # a GGUF path or a registry name (e.g. smollm2-135m)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT  # 0 = any free port (tests)
    api_key: str | None = None  # when set, /v1/* and /tokenize, /detokenize need "Authorization: Bearer <key>"
    ctx: int | None = None  # tokens per sequence; None = the model's context, at most 4096
    parallel: int = 4  # cache slots = sequences decoded together
    max_queue: int = 64  # sequences waiting for a slot before 429 (a request with n=k takes k)
    device: str | None = None  # cpu, cuda0, ...; None = TOY_DEVICE, else auto
    threads: int | None = None  # CPU threads; None = physical cores
    kv_type: str = "f16"  # KV cache type: f16, or f32 for scoring that matches `toy eval logprobs` closely
    flash_attn: bool = False  # ggml's fused attention, with its row-invariant kernel (outputs stay batch-independent)
    prefill_chunk: int = 128  # most prompt tokens prefilled per step (bounds the stall of running streams)
    max_body_bytes: int = 1_000_000  # larger request bodies get 413
    max_batch: int = 64  # most jobs (prompts x n, embedding inputs) per request
    drain_timeout: float = 30.0  # seconds shutdown waits for in-flight requests
    runs_dir: str | None = None  # run bundles go to <runs_dir>/serve-...; None = $TOY_RUNS_DIR or ./runs
    model_alias: str | None = None  # the id in /v1/models; None = the file stem
    lora: tuple[tuple[str, float], ...] = ()  # LoRA adapters (path, scale); "PATH[:SCALE]" strings are parsed
    # selectable adapters (name, path, scale), chosen per request; "NAME=PATH[:SCALE]" strings are parsed
    adapters: tuple[tuple[str, str, float], ...] = ()
    header_timeout: float = 10.0  # seconds for a request's headers to arrive (else 408, the connection closes)
    body_timeout: float = 30.0  # seconds for a request's body to arrive after its headers (else 408)
    constraint_timeout: float = 10.0  # seconds a response_format/grammar/regex/tool constraint may take to compile
    max_connections: int | None = None  # open connections at most (503 beyond); None = from the descriptor limit
    cache_ram: int = 256  # MB of RAM for the prefix cache's blocks; 0 turns the prefix cache off
    cache_dir: str | None = None  # a folder the prefix cache spills blocks to (survives a restart); None = RAM only
    cache_disk: int = 2048  # MB the cache folder may hold (least recently used blocks are deleted beyond)
    slot_save_path: str | None = None  # the folder POST /slots/{id}?action=save|restore reads and writes
    # folders POST /v1/adapters may load adapter files from (none: loading at run time is off, 403)
    adapter_dirs: tuple[str, ...] = ()
    max_adapters: int = 8  # selectable adapters loaded at once beyond which POST /v1/adapters answers 409
    speculative: str = "none"  # the default speculation of requests: none, ngram or draft (needs draft_model)
    draft_model: str | None = None  # a GGUF with the model's vocabulary, drafting for "draft" speculation
    draft_max: int | None = None  # most draft tokens per step; None = the kind's default (ngram 8, draft 4)
    # `toy rpc-server` endpoints ("HOST:PORT"; one comma-separated str is parsed): the layers are split between
    # the local device and them (toy.engine.split); the prefix cache is then off (it needs every layer's K/V local)
    rpc: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] | None = None  # the layers' shares, local device first; None = by free memory

    def __post_init__(self) -> None:
        if isinstance(self.model, Path):
            object.__setattr__(self, "model", str(self.model))
        object.__setattr__(self, "lora", _lora_pairs(self.lora))
        object.__setattr__(self, "adapters", _named_adapters(self.adapters))
        _str("model", self.model)
        _str("host", self.host)
        _int("port", self.port, 0, 65535)
        if self.api_key is not None:
            _str("api_key", self.api_key)
            if any(c.isspace() for c in self.api_key):
                msg = "api_key must not contain whitespace"
                raise BadInputError(msg, hint="a key is sent as 'Bearer <key>'", field="api_key")
        _int("ctx", self.ctx, 16, optional=True)
        _int("parallel", self.parallel, 1, MAX_PARALLEL)
        _int("max_queue", self.max_queue, 1, 1_000_000)
        _str("device", self.device, optional=True)
        _int("threads", self.threads, 1, optional=True)
        if self.kv_type not in ("f16", "f32"):
            raise BadInputError(f"kv_type={self.kv_type!r} must be f16 or f32", field="kv_type")
        if not isinstance(self.flash_attn, bool):
            raise BadInputError(f"flash_attn={self.flash_attn!r} must be true or false", field="flash_attn")
        _int("prefill_chunk", self.prefill_chunk, 1)
        _int("max_body_bytes", self.max_body_bytes, 1024)
        _int("max_batch", self.max_batch, 1)
        _seconds("drain_timeout", self.drain_timeout, 0)
        _seconds("header_timeout", self.header_timeout, MIN_TIMEOUT)
        _seconds("body_timeout", self.body_timeout, MIN_TIMEOUT)
        _seconds("constraint_timeout", self.constraint_timeout, 0.001)
        if self.constraint_timeout > 3600:
            raise BadInputError(
                f"constraint_timeout={self.constraint_timeout!r} must be at most 3600 seconds",
                field="constraint_timeout",
            )
        _int("max_connections", self.max_connections, 1, 1_000_000, optional=True)
        _str("runs_dir", self.runs_dir, optional=True)
        _int("cache_ram", self.cache_ram, 0, 1 << 30)
        _int("cache_disk", self.cache_disk, 0, 1 << 30)
        _str("cache_dir", self.cache_dir, optional=True)
        _str("slot_save_path", self.slot_save_path, optional=True)
        _str("model_alias", self.model_alias, optional=True)
        if isinstance(self.adapter_dirs, (str, Path)):
            object.__setattr__(self, "adapter_dirs", (self.adapter_dirs,))
        object.__setattr__(self, "adapter_dirs", tuple(str(d) for d in self.adapter_dirs or ()))
        for d in self.adapter_dirs:
            _str("adapter_dirs", d)
        _int("max_adapters", self.max_adapters, 1, 4096)
        if self.speculative not in ("none", "ngram", "draft"):
            msg = f"speculative={self.speculative!r} must be none, ngram or draft"
            raise BadInputError(msg, field="speculative")
        _str("draft_model", self.draft_model, optional=True)
        if self.speculative == "draft" and self.draft_model is None:
            msg = "speculative=draft needs a draft model"
            raise BadInputError(msg, hint="give one with --draft-model PATH", field="draft_model")
        _int("draft_max", self.draft_max, 1, 64, optional=True)
        from toy.engine.split import parse_endpoints, parse_tensor_split

        object.__setattr__(self, "rpc", tuple(parse_endpoints(self.rpc)))
        shares = parse_tensor_split(self.tensor_split)
        object.__setattr__(self, "tensor_split", None if shares is None else tuple(shares))
        if shares is not None and not self.rpc:
            msg = "tensor_split needs rpc: with one device there is nothing to split"
            raise BadInputError(msg, hint="add --rpc HOST:PORT or drop --tensor-split", field="tensor_split")

    @property
    def alias(self) -> str:
        """The model id clients see in /v1/models and in every response."""
        return self.model_alias or Path(self.model).stem

    def model_names(self) -> frozenset[str]:
        """Names a request's ``model`` may use: the alias, the path as given, the file name and its stem."""
        p = Path(self.model)
        return frozenset({self.alias, self.model, p.name, p.stem})

    @property
    def connection_limit(self) -> int:
        """The most connections open at once: ``max_connections``, else derived from the descriptor limit."""
        if self.max_connections is not None:
            return self.max_connections
        return default_max_connections()

    @property
    def jobs_per_request(self) -> int:
        """The most jobs one request may create (see ``max_batch`` in the module docstring)."""
        return min(self.max_batch, self.max_queue)

    def config(self) -> dict[str, Any]:
        """A JSON-ready copy for the run bundle, without the API key."""
        d = asdict(self)
        d["api_key"] = "<set>" if self.api_key else None
        d["lora"] = [{"path": p, "scale": sc} for p, sc in self.lora]
        d["adapters"] = [{"name": n, "path": p, "scale": sc} for n, p, sc in self.adapters]
        d["alias"] = self.alias
        d["rpc"] = list(self.rpc)
        d["tensor_split"] = None if self.tensor_split is None else list(self.tensor_split)
        return d


__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "Settings", "default_max_connections"]
