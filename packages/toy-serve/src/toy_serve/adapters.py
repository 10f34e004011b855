"""Selectable LoRA adapters loaded and unloaded while serving
(``POST /v1/adapters``, ``GET /v1/adapters``, ``DELETE /v1/adapters/{name}``):
the server's table of them (``AdapterTable``), the confinement of their paths
to the ``--adapter-dir`` folders, and the holds requests keep on them.

Invariants:

- An adapter's engine index (``Job.adapter``) means the same adapter for as
  long as any request may use it: a request takes a hold when its ``model``
  (``<alias>:<name>``) or ``lora`` field names the adapter (``hold``, before
  anything is queued) and gives it back when the request has ended (the
  guard's per-request cleanup, after its last event). An adapter is unloaded
  (``Model.unload_adapter``, on the engine worker between two steps) only
  once it is being deleted and no hold is left, so a later load that reuses
  its index never meets a request of the old one.
- From the ``DELETE`` on, the name is gone for new requests (404
  ``model_not_found``, as for any adapter that is not loaded); requests that
  already hold it run to their end with it. The name stays taken (409) until
  the memory is freed.
- A path is resolved with ``os.path.realpath`` (symlinks followed; a relative
  path is looked up in the folders, in order) and must lie inside one of
  ``Settings.adapter_dirs`` (themselves resolved the same way), else 403:
  nothing opens a file before that check, and a path that is not a regular
  file (a FIFO, a folder) is a 400 without being opened. Without any
  ``--adapter-dir`` every load is a 403 naming the option.
- Reading, hashing and checking the file and (on the CPU) building its
  tensors run on a thread of their own (``Model.prepare_adapter``); only
  attaching it (``Model.attach_adapter``: the engine's graphs are rebuilt at
  the next step) runs on the worker, between two steps. Decoding of running
  requests therefore waits for at most that one call.
- Exactness: an adapter loaded here gives bit for bit what the same file
  given at start-up (``--lora NAME=PATH``) gives, alone or batched with the
  base and other adapters (``toy.engine.llm``'s selectable adapters).

Decisions: a name taken (loaded, being loaded or being unloaded) is a 409
``adapter_exists``; more than ``Settings.max_adapters`` adapters loaded at
once is a 409 ``too_many_adapters`` (retrying does not help until one is
deleted, so not a 429); start-up adapters (``--lora NAME=PATH``) are listed,
count toward the limit and can be deleted like the others.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any, cast

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from toy.errors import BadInputError
from toy_serve.schemas import AdapterLoadRequest, APIError, ErrorResponse
from toy_serve.server import Server, log


@dataclass
class Entry:
    """One selectable adapter the server knows."""

    name: str
    index: int  # the engine index (Job.adapter)
    path: str | None
    scale: float
    sha256: str | None
    nbytes: int
    source: str  # "startup" (--lora NAME=PATH) or "api" (POST /v1/adapters)
    loaded_at: float
    holds: int = 0  # requests that named it and have not ended
    deleting: bool = False

    def card(self, alias: str) -> dict[str, Any]:
        return {
            "id": f"{alias}:{self.name}",
            "object": "adapter",
            "name": self.name,
            "index": self.index,
            "file": Path(self.path).name if self.path else None,  # the file name only: not the server's paths
            "scale": self.scale,
            "sha256": self.sha256,
            "bytes": self.nbytes,
            "source": self.source,
            "loaded_at": int(self.loaded_at),
            "in_use": self.holds,
            "status": "unloading" if self.deleting else "loaded",
        }


def _forbidden(message: str, hint: str) -> APIError:
    return APIError(403, f"{message} ({hint})", type="permission_error", param="path", code="path_not_allowed")


def confine(path: str, dirs: tuple[str, ...]) -> str:
    """The real path of ``path`` if it lies inside one of ``dirs`` (see the module docstring), else a 403
    ``APIError``; a path there that is not a regular file is a 400. Nothing is opened."""
    if not dirs:
        raise APIError(
            403,
            "loading adapters at run time is off on this server (start toy serve with --adapter-dir DIR)",
            type="permission_error",
            param="path",
            code="adapter_loading_disabled",
        )
    if "\x00" in path:
        raise APIError(400, "path must not contain a NUL character", param="path")
    roots = [os.path.realpath(d) for d in dirs]
    if os.path.isabs(path):
        candidates = [os.path.realpath(path)]
    else:
        candidates = [os.path.realpath(os.path.join(r, path)) for r in roots]
        candidates = [c for c in candidates if os.path.lexists(c)] or candidates[:1]
    real = candidates[0]
    if not any(os.path.commonpath([real, r]) == r for r in roots):
        raise _forbidden(f"path {path!r} is not inside an adapter folder", "see --adapter-dir")
    if not os.path.isfile(real):  # stat only: a FIFO or a device is never opened
        what = "does not exist" if not os.path.lexists(real) else "is not a regular file"
        raise APIError(400, f"path {path!r} {what}", param="path")
    return real


class AdapterTable:
    """The selectable adapters of one server (see the module docstring). ``model``: the served
    ``toy.Model``; ``worker``: its ``EngineWorker``. Thread-safe; the async methods run on the event loop."""

    def __init__(self, model: Any, worker: Any, settings: Any):
        self.model, self.worker, self.settings = model, worker, settings
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}  # every adapter loaded, the ones being deleted included
        self._loading: set[str] = set()  # names reserved by a POST in progress
        now = time.time()
        loaded = model.selectable_adapters() if hasattr(model, "selectable_adapters") else {}
        for name, a in loaded.items():
            e = Entry(name, model.adapter_index(name), a.path, a.scale, a.digest, a.nbytes, "startup", now)
            self._entries[name] = e

    # -- requests

    def live(self) -> list[Entry]:
        """The adapters requests may name, in engine order."""
        with self._lock:
            return sorted((e for e in self._entries.values() if not e.deleting), key=lambda e: e.index)

    def by_index(self) -> list[tuple[str, str | None, float] | None]:
        """(name, path, scale) of each live adapter at its engine index, None in the holes."""
        live = self.live()
        out: list[tuple[str, str | None, float] | None] = [None] * (max((e.index for e in live), default=-1) + 1)
        for e in live:
            out[e.index] = (e.name, e.path, e.scale)
        return out

    def hold(self, name: str | None, cleanup: list[Callable[[], None]]) -> int | None:
        """The engine index of adapter ``name`` (None: the base), held until ``cleanup`` runs (the
        request's end). 404 ``model_not_found`` when it is not loaded (or being deleted)."""
        if name is None:
            return None
        with self._lock:
            e = self._entries.get(name)
            if e is None or e.deleting:
                raise APIError(
                    404,
                    f"no adapter named {name!r} is loaded on this server",
                    param="model",
                    code="model_not_found",
                )
            e.holds += 1
        done = [False]

        def release() -> None:
            if not done[0]:
                done[0] = True
                self._release(e)

        cleanup.append(release)
        return e.index

    def _release(self, e: Entry) -> None:
        with self._lock:
            e.holds -= 1
            last = e.deleting and e.holds == 0
        if last:
            try:
                self._unload(e)
            except Exception:  # noqa: BLE001 - the server is stopping (the model goes with it); never fail a request
                log.debug("adapter %s not unloaded: the server is stopping", e.name, exc_info=True)

    # -- the API

    def cards(self, alias: str) -> list[dict[str, Any]]:
        with self._lock:
            entries = sorted(self._entries.values(), key=lambda e: (e.deleting, e.index))
            return [e.card(alias) for e in entries]

    async def load(self, name: str, path: str, scale: float) -> Entry:
        """Load the adapter file ``path`` under ``name`` (see the module docstring for the errors)."""
        real = confine(path, tuple(self.settings.adapter_dirs))
        with self._lock:
            if name in self._entries or name in self._loading:
                state = "being loaded" if name in self._loading else "loaded"
                if name in self._entries and self._entries[name].deleting:
                    state = "being unloaded"
                raise APIError(
                    409, f"an adapter named {name!r} is already {state}", param="name", code="adapter_exists"
                )
            limit = self.settings.max_adapters
            if len(self._entries) + len(self._loading) >= limit:
                raise APIError(
                    409,
                    f"{limit} adapters are loaded, the most this server holds at once "
                    "(delete one first, or raise --max-adapters)",
                    param="name",
                    code="too_many_adapters",
                )
            self._loading.add(name)
        try:
            t0 = time.perf_counter()
            try:
                prepared = await asyncio.to_thread(self.model.prepare_adapter, name, real, scale)
            except BadInputError as e:  # not an adapter, or not for this model: the message names the mismatch
                hint = f" ({e.hint})" if e.hint else ""
                raise APIError(400, f"{e}{hint}".replace(real, Path(real).name), param="path") from None

            def attach() -> Entry:  # on the worker, between two steps; registered there, so a client gone cannot
                index = self.model.attach_adapter(prepared)  # leave an adapter loaded but unlisted
                e = Entry(name, index, real, prepared.scale, prepared.digest, prepared.nbytes, "api", time.time())
                with self._lock:
                    self._entries[name] = e
                    self._loading.discard(name)
                return e

            fut = self.worker.call(attach)
            fut.add_done_callback(lambda f: prepared.close() if f.cancelled() or f.exception() else None)
            entry = await asyncio.shield(asyncio.wrap_future(fut))
            log.info("loaded adapter %s (%s) in %.3f s", name, Path(real).name, time.perf_counter() - t0)
            return entry
        finally:
            with self._lock:
                self._loading.discard(name)

    async def delete(self, name: str) -> tuple[Entry, bool]:
        """Stop new requests from using ``name`` and unload it once no request holds it. Returns the entry
        and whether it is unloaded already (False: requests still hold it). 404 when it is not loaded."""
        with self._lock:
            e = self._entries.get(name)
            if e is None or e.deleting:
                raise APIError(404, f"no adapter named {name!r} is loaded", param="name", code="adapter_not_found")
            e.deleting = True
            now = e.holds == 0
        if not now:
            return e, False
        await asyncio.shield(asyncio.wrap_future(self._unload(e)))
        return e, True

    def _unload(self, e: Entry) -> Any:
        """Unload ``e`` on the worker (no hold is left); its name is free once that has run."""

        def run() -> None:
            try:
                self.worker.drop_adapter(e.index)
                self.model.unload_adapter(e.name)
                log.info("unloaded adapter %s", e.name)
            finally:
                with self._lock:
                    if self._entries.get(e.name) is e:
                        del self._entries[e.name]

        try:
            return self.worker.call(run)
        except BaseException:  # the worker is stopping: the model goes with it
            with self._lock:
                self._entries.pop(e.name, None)
            raise


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: {"model": ErrorResponse, "description": HTTPStatus(c).phrase} for c in codes}


def add_adapter_routes(app: FastAPI, srv: Server) -> None:
    """``GET``/``POST /v1/adapters`` and ``DELETE /v1/adapters/{name}`` (behind the API key, as every /v1 path;
    what they answer is documented in tools/serve_api_docs.py's ``ROUTES`` and the module docstring)."""
    alias = srv.settings.alias

    def table() -> AdapterTable:
        srv.ready()
        assert srv.table is not None  # ready() says the worker (and the table) run
        return cast(AdapterTable, srv.table)

    @app.get("/v1/adapters", responses=_errors(401, 500, 503))
    async def list_adapters() -> Response:
        return JSONResponse({"object": "list", "data": table().cards(alias)})

    @app.post("/v1/adapters", status_code=201, responses=_errors(400, 401, 403, 409, 413, 500, 503))
    async def load_adapter(body: AdapterLoadRequest) -> Response:
        e = await table().load(body.name, body.path, body.scale)
        return JSONResponse(e.card(alias), status_code=201)

    @app.delete("/v1/adapters/{name}", responses={**_errors(401, 404, 500, 503), 202: {"description": "Unloading"}})
    async def delete_adapter(name: str) -> Response:
        e, done = await table().delete(name)
        card = {**e.card(alias), "deleted": True, "status": "unloaded" if done else "unloading"}
        return JSONResponse(card, status_code=200 if done else 202)


__all__ = ["AdapterTable", "Entry", "add_adapter_routes", "confine"]
