"""One app's state (``Server``: settings, model, worker, metrics, run bundle)
and the request paths the other modules share. See ``toy_serve.app`` for the
app's invariants and decisions."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from toy_serve.metrics import Metrics
from toy_serve.schemas import APIError
from toy_serve.settings import Settings
from toy_serve.worker import EngineWorker

log = logging.getLogger("toy_serve")

COMPLETIONS, CHAT, EMBEDDINGS = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
ENDPOINTS = {
    "/health",
    "/v1/models",
    "/metrics",
    COMPLETIONS,
    CHAT,
    EMBEDDINGS,
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/server_info",
    "/v1/adapters",
}
OPEN_PATHS = {"/health", "/metrics", "/openapi.json"}
LOGGED = {COMPLETIONS, CHAT, EMBEDDINGS}
DEFAULT_PARAM = {
    COMPLETIONS: "prompt",
    CHAT: "messages",
    EMBEDDINGS: "input",
    "/tokenize": "content",
    "/detokenize": "tokens",
    "/v1/adapters": "path",
}
POLL_S = 0.25


class Server:
    """Everything one app owns: settings, model, worker, metrics, run bundle."""

    error: str | None  # why loading failed (status "error")

    def __init__(self, settings: Settings, model: Any | None):
        self.settings, self.model, self.owns_model = settings, model, model is None
        self.metrics = Metrics()
        self.worker: EngineWorker | None = None
        self.writer: Any = None
        self.status, self.error = "loading", None
        self.created = int(time.time())
        self.names = settings.model_names()
        self.on_fatal: Any = None  # set by the CLI: called with the exception when loading fails
        self.n_requests = 0
        self.abandoned: int | None = None  # sequences ended by the shutdown (set once by abandon)
        self.table: Any = None  # the selectable adapters (toy_serve.adapters.AdapterTable), once the worker runs
        self.prefix: Any = None  # the prefix cache (toy.engine.prefix.PrefixCache), when on
        self.fingerprint: Any = None  # what the model's K/V depend on (slot files, the cache's disk folder)
        self.draft: Any = None  # the --draft-model (a toy.Model), loaded with the worker, closed after it
        self.remote_failure: str | None = None  # a remote device (--rpc) that failed while serving, and why

    def _load(self) -> Any:
        import toy

        s = self.settings
        return toy.load(
            s.model,
            device=s.device,
            n_ctx=s.ctx,
            threads=s.threads,
            n_slot=s.parallel,
            kv_type=s.kv_type,
            flash_attn=s.flash_attn,
            exact_batching=True,
            lora=list(s.lora) or None,
            adapters={name: (path, scale) for name, path, scale in s.adapters} or None,
            rpc=s.rpc,
            tensor_split=s.tensor_split,
        )

    def adapters(self) -> list[tuple[str | None, float]]:
        """The LoRA adapters applied: the loaded model's, else (still loading) the settings'."""
        if self.model is not None:
            return list(getattr(self.model, "adapters", []))
        return list(self.settings.lora)

    def _begin(self) -> None:
        from toy.runs.writer import RunWriter

        m, s = self.model, self.settings
        assert m is not None  # start() loads the model first
        info = {"path": str(m.path), "alias": s.alias, "n_ctx": m.engine.n_ctx, "n_slot": m.engine.n_slot}
        info.update(n_vocab=m.cfg.n_vocab, d_model=m.cfg.d_model, n_layer=m.cfg.n_layer)
        if m.placement.split:  # a model split across hosts (--rpc): where its layers went
            info["placement"] = m.placement.to_dict()
            log.info("%s: %s", m.path.name, m.describe())
        info["lora"] = [{"path": p, "scale": sc} for p, sc in self.adapters()]
        self.writer = RunWriter("serve", s.config(), root=s.runs_dir, model=info)
        try:
            self.prefix = self._prefix_cache(m)
            self.draft = self._draft_model(m)
            self.worker = EngineWorker(
                m,
                max_queue=s.max_queue,
                prefill_chunk=s.prefill_chunk,
                metrics=self.metrics,
                prefix_cache=self.prefix,
                draft=self.draft,
                speculative=s.speculative,
                draft_max=s.draft_max,
            )
            # a remote device (--rpc) that fails ends the requests in flight (the worker's error event names
            # it) and makes /health report the failure: the model cannot compute again until restarted
            self.worker.on_remote_failure = self.remote_failed
            self.worker.start()
            from toy_serve.adapters import AdapterTable

            self.table = AdapterTable(m, self.worker, s)
        except BaseException:
            self.writer.end("errored")
            raise
        self.status = "ok"

    def _draft_model(self, m: Any) -> Any:
        """The ``--draft-model`` loaded with the model's slots and context (None without one); its vocabulary
        must be the model's (``toy.engine.speculative.check_vocab``)."""
        s = self.settings
        if s.draft_model is None:
            return None
        import toy
        from toy.engine.speculative import check_vocab

        d = toy.load(
            s.draft_model, device=s.device, n_ctx=m.engine.n_ctx, threads=s.threads, n_slot=m.engine.n_slot, fetch=False
        )
        try:
            check_vocab(d, m)
        except BaseException:
            d.close()
            raise
        return d

    def _prefix_cache(self, m: Any) -> Any:
        """The prefix cache the settings ask for (None when off, or when the KV cache is not in CPU memory)."""
        from toy.engine.prefix import PrefixCache, fingerprint

        s = self.settings
        # the model file's sha256 only when files outlive the process (a folder of blocks, slot files)
        self.fingerprint = fingerprint(m, full=bool(s.cache_dir or s.slot_save_path))
        if s.cache_ram == 0:
            return None
        if m.engine.cache.device != "CPU":  # a device, or a model split across hosts ("CPU+RPC0[...]")
            log.warning("the prefix cache is CPU-only for now: off on %s", m.engine.cache.device)
            return None
        cache = PrefixCache(self.fingerprint, s.cache_ram << 20, s.cache_dir, s.cache_disk << 20)
        self.metrics.watch_prefix_cache(lambda: cache.stats)
        return cache

    async def start(self) -> None:
        try:
            if self.model is None:
                self.model = await asyncio.to_thread(self._load)
            if self.status == "stopping":  # stopped while loading: it never served, so it leaves no run bundle
                return
            self._begin()
        except Exception as e:  # noqa: BLE001 - reported on /health and to the CLI
            self.status, self.error = "error", f"{type(e).__name__}: {e}"
            log.error("the server could not start: %s", self.error)
            if self.on_fatal:
                self.on_fatal(e)

    async def abandon(self) -> int:
        """Stop the worker: every sequence still queued or running ends with the error event "the server
        is shutting down" (a stream's error chunk, a 503). Returns how many; later calls return the same."""
        if self.abandoned is None and self.worker is not None:
            self.abandoned = self.worker.busy()
            await asyncio.to_thread(self.worker.stop)
        return self.abandoned or 0

    async def stop(self, loading: asyncio.Task | None) -> None:
        self.status = "stopping"
        if loading is not None:
            await loading  # a model being loaded is waited for (a thread cannot be cancelled), then closed
            self.status = "stopping"
        if self.worker is not None and self.abandoned is None:  # not drained yet (toy serve's ToyUvicorn does)
            deadline = time.monotonic() + self.settings.drain_timeout
            while self.worker.busy() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        left = await self.abandon()
        if self.writer is not None:
            self.writer.end("completed", requests=self.n_requests, abandoned=left)
        if self.draft is not None:
            await asyncio.to_thread(self.draft.close)
            self.draft = None
        if self.owns_model and self.model is not None:
            await asyncio.to_thread(self.model.close)

    def remote_failed(self, exc: BaseException) -> None:
        """A remote device of a model split across hosts (``--rpc``) failed: its connection stays dead, so
        from now on /health answers 503 {"status": "error", "message": <the device and why>} (a router takes
        the replica out of rotation) and every request 503 with that message. Called on the worker's thread."""
        if self.status == "ok":
            self.remote_failure = str(exc)
            self.status, self.error = "error", self.remote_failure
            log.error("a remote device failed; restart the server once it is back: %s", exc)

    def ready(self) -> Any:
        if self.status != "ok":
            what = {"loading": "the model is still loading", "stopping": "the server is shutting down"}
            if self.remote_failure is not None:
                what["error"] = self.remote_failure
            msg = what.get(self.status, f"the model failed to load: {self.error}")
            raise APIError(503, msg, type="server_error", code="model_loading" if self.status == "loading" else None)
        return self.model

    def adapter_names(self) -> list[str]:
        """The selectable adapters requests may name now (the settings' until the model is loaded)."""
        if self.table is not None:
            return [e.name for e in self.table.live()]
        return [n for n, _, _ in self.settings.adapters]

    def adapter_slots(self) -> list[Any]:
        """(name, path, scale) of each selectable adapter at its engine index, None in the holes."""
        if self.table is not None:
            return self.table.by_index()
        return list(self.settings.adapters)

    def hold_adapter(self, name: str | None, request: Any) -> int | None:
        """The engine index of adapter ``name`` (None: the base), held until ``request`` ends (404 when it is not
        loaded); see ``toy_serve.adapters``."""
        if name is None:
            return None
        return self.table.hold(name, request.scope.setdefault("toy.cleanup", []))

    def check_model(self, name: str | None) -> str | None:
        """The adapter's name when ``name`` is ``<model>:<adapter>`` (404 ``model_not_found`` when that adapter
        is not loaded), None for the served model; 400 ``model_not_found`` for any other model."""
        if not name or name in self.names:
            return None
        base, sep, adapter = name.rpartition(":")
        names, alias = self.adapter_names(), self.settings.alias
        if sep and base in self.names:
            if adapter in names:
                return adapter
            known = ", ".join(f"{alias}:{n}" for n in names) or "none are loaded"
            msg = f"adapter {name!r} is not loaded here (adapters: {known})"
            raise APIError(404, msg, param="model", code="model_not_found")
        msg = f"model {name!r} is not served here (this server serves {alias!r}"
        if names:
            msg += ", with adapters " + ", ".join(f"{alias}:{n}" for n in names)
        raise APIError(400, msg + ")", param="model", code="model_not_found")

    def log_request(self, rid: str, endpoint: str, status: int, stats: dict, duration: float) -> None:
        self.n_requests += 1
        if self.writer is None:
            return
        ttft, done = stats.get("ttft_s"), stats.get("completion_tokens")
        tok_s = done / (duration - ttft) if ttft is not None and done and duration > ttft else None
        fields = {"prompt_tokens": stats.get("prompt_tokens"), "completion_tokens": done, "ttft_s": ttft}
        fields.update(duration_s=duration, tok_s=tok_s, finish_reason=stats.get("finish_reason"))
        try:
            self.writer.event("request", request_id=rid, endpoint=endpoint, status=status, **fields)
        except RuntimeError:  # the run has ended (shutdown raced a late request)
            pass


def internal(message: str, rid: str | None) -> APIError:
    return APIError(500, f"{message} (request id {rid})", type="server_error", code="internal_error")
