"""Inference: ``toy_vit.load(path)`` -> ``Classifier`` with ``logits`` and
``classify``.

Decisions:

- The runtime is chosen as ``toy.load`` chooses it: ``device`` flag >
  ``TOY_DEVICE`` > auto, ``threads`` default the physical cores
  (``TOY_THREADS`` overrides). The weights are the file's tensors bound on
  that runtime (zero-copy into the read-only map on the CPU); the file
  stays open as long as the classifier.
- One graph per batch size, built on first use and kept (at most
  ``max_graphs``, least recently used dropped): a call is one upload of the
  patches and one compute per batch. ``classify`` cuts its images into
  batches of ``batch_size``, so it builds at most two graphs (the full batch
  and the remainder).
- ``logits`` takes pixels already normalised, F32 (B, C, H, W) at the
  model's size (``toy_vit.preprocess`` makes them). ``classify`` takes
  images (paths, PIL images or arrays), preprocesses them with the model's
  size, mean and std, and returns for each image its ``top_k`` classes as
  ``(label, probability)`` pairs, most probable first (softmax in float64).
- ``exact_batching=True``: every product row-invariant (toy-ggml patch
  0004), so an image's logits are bit-identical whatever batch it is in;
  the default lets the CPU use its batched kernels (faster; the logits then
  agree across batch sizes to float32 rounding, not always to the bit).
- Not thread-safe: one classifier serves one thread. ``close()`` is
  idempotent; use after close raises ``toy_ggml.ClosedError``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import toy_ggml
from toy.errors import BadInputError
from toy_vit.config import ViTConfig

F32 = toy_ggml.GGMLType.F32


class Classifier:
    """A loaded ViT classifier (see ``toy_vit.load``). ``config`` is its
    ``ViTConfig``, ``labels`` its class names, ``path`` the file."""

    def __init__(self, path: Path, cfg: ViTConfig, gguf, weights, runtime, exact_batching=False, max_graphs=4):
        self.path, self.config, self.runtime = path, cfg, runtime
        self._gguf, self._weights = gguf, weights
        self.exact_batching = bool(exact_batching)
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[int, tuple] = OrderedDict()  # batch -> (inputs ctx, ops ctx, graph, patches, out)
        self.graph_builds = 0
        self._closed = False

    @property
    def labels(self) -> tuple[str, ...]:
        return self.config.labels

    def _check(self) -> None:
        if self._closed:
            raise toy_ggml.ClosedError("the classifier is closed")

    def _graph(self, batch: int):
        g = self._graphs.get(batch)
        if g is not None:
            self._graphs.move_to_end(batch)
            return g
        from toy_vit.model import forward, graph_size

        cfg = self.config
        cin = toy_ggml.Context(max_tensors=4)
        patches = cin.tensor(F32, (batch, cfg.n_tokens, cfg.patch_dim), name="patches")
        cin.allocate(self.runtime)
        size = graph_size(cfg)
        ops = toy_ggml.Context(max_tensors=size)
        ops.gemm = self.runtime.cpu_gemm  # F32 products on toy's CPU GEMM (row-invariant too)
        try:
            out = forward(ops, cfg, self._weights, patches, batch, row_invariant=self.exact_batching)
            out.set_output()
            graph = toy_ggml.Graph(ops, size=max(2048, 2 * size)).build_forward(out)
        except BaseException:
            ops.close()
            cin.close()
            raise
        if len(self._graphs) >= self.max_graphs:
            _, (c0, o0, *_rest) = self._graphs.popitem(last=False)
            o0.close()
            c0.close()
        g = self._graphs[batch] = (cin, ops, graph, patches, out)
        self.graph_builds += 1
        return g

    def logits(self, pixels: np.ndarray) -> np.ndarray:
        """Logits float32 (B, n_classes) of normalised pixels float32
        (B, C, H, W) at the model's image size, in one compute."""
        self._check()
        from toy_vit.model import patchify

        p = patchify(pixels, self.config)
        _cin, _ops, graph, patches, out = self._graph(p.shape[0])
        patches.set(p)
        self.runtime.compute(graph)
        return out.numpy()

    def classify(self, images: Any, top_k: int = 5, batch_size: int = 32) -> list[list[tuple[str, float]]]:
        """The ``top_k`` (label, probability) pairs of each image, most
        probable first. ``images``: a sequence of paths, PIL images or
        arrays (or one of them), preprocessed with the model's size, mean
        and std."""
        self._check()
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise BadInputError(f"top_k={top_k!r} must be a whole number >= 1")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise BadInputError(f"batch_size={batch_size!r} must be a whole number >= 1")
        from PIL import Image

        from toy_vit.preprocess import preprocess

        if isinstance(images, np.ndarray):  # one image, or a (B, H, W, C) batch
            images = list(images) if images.ndim == 4 else [images]
        elif isinstance(images, (str, os.PathLike, Image.Image)) or not isinstance(images, Sequence):
            images = [images]
        if len(images) == 0:
            raise BadInputError("classify: no images")
        cfg, k = self.config, min(top_k, self.config.n_classes)
        results: list[list[tuple[str, float]]] = []
        for a in range(0, len(images), batch_size):
            chunk = list(images[a : a + batch_size])
            pixels = preprocess(chunk, cfg.image_size, cfg.image_mean, cfg.image_std, cfg.n_channels)
            z = self.logits(pixels).astype(np.float64)
            z -= z.max(axis=1, keepdims=True)
            prob = np.exp(z)
            prob /= prob.sum(axis=1, keepdims=True)
            order = np.argsort(-prob, axis=1, kind="stable")[:, :k]
            results += [[(cfg.labels[j], float(prob[i, j])) for j in order[i]] for i in range(len(chunk))]
        return results

    # -- lifetime

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for cin, ops, *_ in self._graphs.values():
            ops.close()
            cin.close()
        self._graphs.clear()
        self._weights.close()
        self._gguf.close()
        self.runtime.close()

    def __enter__(self) -> Classifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Classifier({self.path.name}, {c.image_size}px/{c.patch_size}, d={c.d_model}, L={c.n_layer}, "
            f"{c.n_classes} classes, device={self.runtime.device!r})"
        )


def load(
    path: str | os.PathLike,
    *,
    threads: int | None = None,
    device: str | None = None,
    exact_batching: bool = False,
) -> Classifier:
    """Open a ViT classifier GGUF (written by ``toy vit convert`` or a
    ``toy vit`` training run). ``threads``: CPU threads (default the
    physical cores; ``TOY_THREADS`` overrides); ``device``: flag >
    ``TOY_DEVICE`` > auto. ``exact_batching``: see the module docstring.
    ``toy.gguf.GGUFError`` for a file that is not GGUF,
    ``toy_vit.gguf_io.ViTFileError`` for one that is not a ViT classifier."""
    from toy.gguf import GGUFFile, bind_tensors
    from toy_vit.gguf_io import config_from_gguf

    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise BadInputError(f"threads={threads!r} must be a whole number >= 1")
    gf = GGUFFile(path)
    runtime = weights = None
    try:
        cfg = config_from_gguf(gf)
        n_threads, adaptive = toy_ggml.runtime_threads(threads)  # default: adapts to the machine's load
        runtime = toy_ggml.Runtime(toy_ggml.resolve_device(device), threads=n_threads, adaptive=adaptive)
        weights = bind_tensors(gf, runtime)
        return Classifier(Path(path), cfg, gf, weights, runtime, exact_batching=exact_batching)
    except BaseException:
        if weights is not None:
            weights.close()
        if runtime is not None:
            runtime.close()
        gf.close()
        raise


__all__ = ["Classifier", "load"]
