"""Where a model's layers go when it is split across devices (ggml RPC).

``toy.load(rpc=[...])`` adds remote devices (``toy rpc-server`` on other
machines, reached through ggml's RPC backend) beside the local one. This
module decides, before anything is allocated, which device holds each
layer; it does no I/O and knows nothing of ggml, so the rule can be tested
alone:

- Layers go in contiguous blocks: the local device first, then each remote
  in the order given. A layer's weights and its KV cache live on its device;
  the token embeddings, the output norm and the head stay local, so the
  first and last steps of a forward never cross the network.
- The share of each device is given (``tensor_split``: one number per
  device, local first, any scale) or, by default, proportional to the free
  memory each device reports. A device reporting no figure (0) makes the
  default an even split: a mix of known and unknown figures says nothing.
- A device whose share rounds to no layer gets none (it stays registered,
  unused). Boundaries are the rounded cumulative shares, so the counts add up
  to the layer count exactly and equal shares give blocks that differ by at
  most one layer (15/15 for 30 layers on two devices, 10/10/10 on three).

Endpoints are ``HOST:PORT``, the host an IPv4 address or a name (ggml's RPC
transport is IPv4 only). A
remote device that fails during a compute ends the request with
``RemoteDeviceError`` naming the endpoint: the engine's state is then
unknown, so callers stop using the model (the CLI exits 1; the server answers
the request with an error and reports it on /health).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from toy.errors import BadInputError, ToyError

DEFAULT_PORT = 50052

_LAYER = re.compile(r"^blk\.(\d+)\.")


class RemoteDeviceError(ToyError):
    """A remote (RPC) device failed while computing or could not be reached:
    the request that used it failed. ``endpoint`` names the host."""

    def __init__(self, message: str, hint: str | None = None, endpoint: str | None = None):
        super().__init__(message, hint)
        self.endpoint = endpoint


def remote_failure(exc: BaseException, doing: str) -> RemoteDeviceError | None:
    """``exc`` as a ``RemoteDeviceError`` when it is toy_ggml's ``RPCError`` (a remote device's
    server lost, silent, or refusing), else None. ``doing``: what failed ("generating")."""
    if type(exc).__name__ != "RPCError" or not hasattr(exc, "endpoint"):  # toy_ggml.RPCError, without importing it
        return None
    endpoint = exc.endpoint or None
    return RemoteDeviceError(
        f"{doing} failed on a remote device: {exc}",
        hint=f"check that `toy rpc-server` still runs at {endpoint or 'the --rpc endpoint'} and is reachable from "
        "here, then load the model again",
        endpoint=endpoint,
    )


def parse_endpoint(text: str) -> str:
    """``HOST:PORT`` checked and normalized (whitespace stripped); ``BadInputError``
    (field ``rpc``) for anything else. A port is 1..65535; the host an IPv4 address or a name."""
    s = text.strip()
    m = re.fullmatch(r"([A-Za-z0-9_.-]+):(\d{1,5})", s)
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        raise BadInputError(
            f"RPC endpoint {text!r} is not HOST:PORT",
            hint=f"e.g. 127.0.0.1:{DEFAULT_PORT} (an IPv4 address or a host name: the RPC transport has no IPv6)",
            field="rpc",
        )
    return f"{m.group(1)}:{int(m.group(2))}"


def parse_endpoints(value: str | Sequence[str] | None) -> list[str]:
    """The endpoints of ``--rpc A,B`` (a comma-separated str) or a sequence of them
    (each item may itself hold commas); none for None or "". A repeated endpoint is refused."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    out: list[str] = []
    for item in items:
        for part in str(item).split(","):
            if not part.strip():
                continue
            ep = parse_endpoint(part)
            if ep in out:
                raise BadInputError(f"RPC endpoint {ep} is given twice", hint="name each rpc-server once", field="rpc")
            out.append(ep)
    return out


def parse_tensor_split(value: str | Sequence[float] | None) -> list[float] | None:
    """The proportions of ``--tensor-split 3,1`` (a comma-separated str) or a sequence of
    numbers; None for None or "". Each is finite and >= 0, and at least one is > 0."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    parts: Sequence = value.split(",") if isinstance(value, str) else value
    out: list[float] = []
    for p in parts:
        try:
            x = float(p)
        except (TypeError, ValueError):
            raise BadInputError(
                f"tensor split {p!r} is not a number", hint="e.g. --tensor-split 3,1", field="tensor_split"
            ) from None
        if not math.isfinite(x) or x < 0:
            raise BadInputError(
                f"tensor split {p!r} must be a finite number >= 0", hint="e.g. 3,1", field="tensor_split"
            )
        out.append(x)
    if not out or sum(out) <= 0:
        raise BadInputError(
            "the tensor split gives no device a share", hint="give one device a share > 0", field="tensor_split"
        )
    return out


def layer_of(name: str) -> int | None:
    """The layer index of a GGUF tensor name (``blk.<i>.*``), or None for the rest
    (embeddings, output norm, head: these stay on the local device)."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def plan_layers(n_layer: int, shares: Sequence[float]) -> list[int]:
    """The device index (into ``shares``) of each of ``n_layer`` layers: contiguous
    blocks in device order, sized by ``shares`` (non-negative, at least one > 0)."""
    if n_layer < 0:
        raise ValueError(f"n_layer={n_layer} must be >= 0")
    if not shares or any(not math.isfinite(s) or s < 0 for s in shares) or sum(shares) <= 0:
        raise ValueError(f"shares {list(shares)} must be finite, >= 0, and not all 0")
    total = float(sum(shares))
    bounds, acc = [], 0.0
    for s in shares:
        acc += s
        bounds.append(round(n_layer * acc / total))
    bounds[-1] = n_layer  # the sum of floats may fall a hair short
    plan, d = [], 0
    for i in range(n_layer):
        while i >= bounds[d]:
            d += 1
        plan.append(d)
    return plan


def shares_for(free_memory: Sequence[int], tensor_split: Sequence[float] | None) -> list[float]:
    """The shares of ``plan_layers``: ``tensor_split`` when given (one per device,
    ``BadInputError`` otherwise), else each device's free memory, else (a device
    reporting 0: unknown) an even split."""
    n = len(free_memory)
    if tensor_split is not None:
        if len(tensor_split) != n:
            raise BadInputError(
                f"the tensor split has {len(tensor_split)} numbers for {n} devices",
                hint="give one number per device: the local one first, then each --rpc endpoint in order",
                field="tensor_split",
            )
        return [float(x) for x in tensor_split]
    if n and all(m > 0 for m in free_memory):
        return [float(m) for m in free_memory]
    return [1.0] * n


@dataclass(frozen=True)
class Placement:
    """Which device holds each layer. ``devices``: the backend names (``Runtime.backends``
    spelling), local first; ``labels``: how a user reads them ("CPU", "RPC[10.0.0.2:50052]");
    ``layers[i]``: the index into both of layer ``i``'s device."""

    devices: tuple[str, ...]
    labels: tuple[str, ...]
    layers: tuple[int, ...]

    @property
    def split(self) -> bool:
        """Whether any layer lies off the local device."""
        return any(d != 0 for d in self.layers)

    def device_of(self, name: str) -> str:
        """The backend name of the device that holds the GGUF tensor ``name``."""
        i = layer_of(name)
        if i is None or i >= len(self.layers):
            return self.devices[0]
        return self.devices[self.layers[i]]

    def blocks(self) -> list[tuple[int, int, int]]:
        """(first layer, last layer, device index) of each device's contiguous block, in order."""
        out: list[tuple[int, int, int]] = []
        for i, d in enumerate(self.layers):
            if out and out[-1][2] == d:
                out[-1] = (out[-1][0], i, d)
            else:
                out.append((i, i, d))
        return out

    def describe(self) -> str:
        """``layers 0-14 CPU, 15-29 RPC[10.0.0.2:50052]``."""
        parts = [(f"{a}" if a == b else f"{a}-{b}") + f" {self.labels[d]}" for a, b, d in self.blocks()]
        return "layers " + ", ".join(parts) if parts else "no layers"

    def to_dict(self) -> dict:
        return {
            "devices": list(self.labels),
            "layers": [{"first": a, "last": b, "device": self.labels[d]} for a, b, d in self.blocks()],
        }


def plan(
    n_layer: int,
    devices: Sequence[str],
    labels: Sequence[str],
    free_memory: Sequence[int],
    tensor_split: Sequence[float] | None = None,
) -> Placement:
    """The placement of ``n_layer`` layers on ``devices`` (local first; see the module docstring)."""
    layers = plan_layers(n_layer, shares_for(free_memory, tensor_split))
    return Placement(tuple(devices), tuple(labels), tuple(layers))


__all__ = [
    "DEFAULT_PORT",
    "Placement",
    "RemoteDeviceError",
    "layer_of",
    "parse_endpoint",
    "parse_endpoints",
    "parse_tensor_split",
    "plan",
    "plan_layers",
    "remote_failure",
    "shares_for",
]
