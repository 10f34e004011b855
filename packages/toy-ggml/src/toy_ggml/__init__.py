"""toy_ggml: thin Python bindings over a pinned, patched ggml.

The pieces:

- ``Context`` makes tensors (``ctx.tensor(dtype, shape)``) and ops
  (``ctx.mul_mat(a, b)``, ``ctx.rope(...)``...). Shapes are NumPy order.
- ``Graph`` collects what to compute (``build_forward``) and its gradients
  (``build_backward``).
- ``Runtime`` owns a device backend, the CPU backend and a scheduler over both
  (plus any extra devices, such as remote ones from ``rpc_connect``), and
  computes graphs with the GIL released.
- Tensors read and write NumPy arrays by explicit copy (``numpy()``, ``set()``),
  or bind zero-copy into Python memory such as an mmap (``buffer_from_memory``
  and ``Tensor.bind``), read-only where the memory is.

Everything ggml would abort on is checked first and raised as ``ValueError``,
``TypeError`` or ``GGMLError``. ggml's log goes to the ``toy_ggml`` logger.
"""

from toy_ggml import _build_config as build_config
from toy_ggml import _dispatch
from toy_ggml._core import (
    BACKWARD_GLU_OPS,
    BACKWARD_OPS,
    BACKWARD_UNARY_OPS,
    Buffer,
    Context,
    Graph,
    Runtime,
    Tensor,
    buffer_from_memory,
    cpu_features,
    dequantize,
    quantizable_types,
    quantize,
)
from toy_ggml._dispatch import Plugin, cpu_variant, plugins, sum_step
from toy_ggml.devices import (
    Device,
    default_threads,
    device_name,
    devices,
    physical_cores,
    resolve_device,
    runtime_threads,
)
from toy_ggml.dtypes import GGMLType, TypeTraits, type_info
from toy_ggml.errors import ClosedError, GGMLError, RPCError, UnsupportedBackwardError
from toy_ggml.rpc import rpc_available, rpc_connect, rpc_serve

_dispatch.load()  # exactly one CPU backend variant per process (see toy_ggml._dispatch)

__version__ = "0.1.0"
GGML_VERSION = build_config.GGML_VERSION

__all__ = [
    "BACKWARD_GLU_OPS",
    "BACKWARD_OPS",
    "BACKWARD_UNARY_OPS",
    "Buffer",
    "ClosedError",
    "Context",
    "Device",
    "GGMLError",
    "GGMLType",
    "GGML_VERSION",
    "Graph",
    "Plugin",
    "RPCError",
    "Runtime",
    "Tensor",
    "TypeTraits",
    "UnsupportedBackwardError",
    "build_config",
    "buffer_from_memory",
    "cpu_features",
    "cpu_variant",
    "default_threads",
    "dequantize",
    "device_name",
    "devices",
    "physical_cores",
    "plugins",
    "quantizable_types",
    "quantize",
    "resolve_device",
    "rpc_available",
    "rpc_connect",
    "rpc_serve",
    "runtime_threads",
    "sum_step",
    "type_info",
]
