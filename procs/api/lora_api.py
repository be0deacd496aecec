"""vLLM's runtime LoRA endpoints, on with `--enable-lora-runtime-updates` (vLLM gates them with an
environment variable): `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}` checks the PEFT folder
here (its config and its tensors' names, `shared.lora.check_adapter`), gives the name the next adapter
index and sends the load on the requests' path (`shared.messages.AdapterUpdate`), so that a request sent
after the answer runs on it; `POST /v1/unload_lora_adapter` `{"lora_name"}` answers a new request naming it
with 404 at once, while the requests in flight finish on its weights and the worker frees them after
the last (`procs.scheduler.lora.adapter_updates`). Under `/v1/`, so with API keys they need one. A name loaded
again is a new index: its prefix cache never serves the old weights' KV. With data-parallel replicas the
replica that takes the update (a gateway picks one) passes it on to the others, so every replica serves
the same adapters.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from batchserve.procs.api.auth import internal_key
from batchserve.procs.api.errors import error_response
from batchserve.procs.api.schemas import LoadLoraBody, UnloadLoraBody, decode_body
from batchserve.shared.errors import ModelLoadError, Refusal
from batchserve.shared.lora import check_adapter, served_projections
from batchserve.shared.messages import AdapterUpdate
from batchserve.shared.model import ModelSpec, read_model_json
from batchserve.shared.parallel import peer_replica_urls

FROM_REPLICA = "X-Batchserve-From-Replica"  # an update passed on by another replica: not passed on again
PEER_TIMEOUT_S = 60.0


def add_lora_routes(app: web.Application, handlers) -> None:
    """Register the two endpoints on the api's application (`handlers`: its `ApiHandlers`)."""
    routes = _LoraRoutes(handlers)
    app.router.add_post("/v1/load_lora_adapter", routes.load)
    app.router.add_post("/v1/unload_lora_adapter", routes.unload)


class _LoraRoutes:
    def __init__(self, handlers) -> None:
        self.handlers = handlers
        self.lock = asyncio.Lock()  # one update at a time: a name is checked and taken together
        self.served_projections: frozenset[str] | None = None

    def _served_projections(self) -> frozenset[str]:
        """What the model's adapters may target (the worker refuses the same at load): read once, when needed."""
        if self.served_projections is None:
            spec = ModelSpec.from_config(self.handlers.config)
            self.served_projections = served_projections(read_model_json(spec.model_dir))
        return self.served_projections

    async def load(self, request: web.Request) -> web.Response:
        try:
            raw = await self.handlers._read_body(request)
            body = decode_body(raw, LoadLoraBody)
            async with self.lock:
                served = self.handlers.served
                served.check_free(body.lora_name)
                try:
                    await asyncio.to_thread(
                        check_adapter, body.lora_path, self.handlers.config.max_lora_rank, self._served_projections()
                    )
                except ModelLoadError as exc:
                    raise Refusal(str(exc), "lora_path") from None
                index = served.load(body.lora_name)
                try:
                    await self.handlers.engine.update_adapter(
                        AdapterUpdate(index=index, name=body.lora_name, path=body.lora_path)
                    )
                except Refusal:
                    served.unload(body.lora_name)  # never sent: not served
                    raise
        except Refusal as exc:
            return error_response(exc.status, exc.message, exc.param, exc.code)
        return await self._on_every_replica(
            request, raw, f"Success: LoRA adapter '{body.lora_name}' added successfully."
        )

    async def unload(self, request: web.Request) -> web.Response:
        try:
            raw = await self.handlers._read_body(request)
            body = decode_body(raw, UnloadLoraBody)
            async with self.lock:
                index = self.handlers.served.unload(body.lora_name)
                await self.handlers.engine.update_adapter(AdapterUpdate(index=index, name=body.lora_name))
        except Refusal as exc:
            return error_response(exc.status, exc.message, exc.param, exc.code)
        return await self._on_every_replica(
            request, raw, f"Success: LoRA adapter '{body.lora_name}' removed successfully."
        )

    async def _on_every_replica(self, request: web.Request, raw: bytes, success: str) -> web.Response:
        """Done here: pass the same update to every other replica of this server (a gateway sends a POST to one
        of them), unless it came from one; 200 with `success` once every replica answered 200, else 502
        naming those that did not (the replicas that did keep the change)."""
        config = self.handlers.config
        if config.data_parallel_size < 2 or request.headers.get(FROM_REPLICA):
            return web.Response(text=success)
        key = internal_key()  # the replicas' shared key; else the client's own, which every replica accepts
        auth = (
            {"Authorization": f"Bearer {key}"}
            if key
            else {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        )
        peers = peer_replica_urls(config)  # the app's config: its port is this replica's own
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PEER_TIMEOUT_S)) as http:
            failures = [
                f
                for f in await asyncio.gather(*(self._send(http, url + request.path, raw, auth) for url in peers))
                if f
            ]
        if failures:
            return error_response(502, f"done on this replica, not on every other: {'; '.join(failures)}")
        return web.Response(text=success)

    @staticmethod
    async def _send(http: aiohttp.ClientSession, url: str, raw: bytes, auth: dict[str, str]) -> str:
        """POST the update to one replica: "" once it answers 200, else what went wrong there."""
        headers = {**auth, FROM_REPLICA: "1", "Content-Type": "application/json"}
        try:
            async with http.post(url, data=raw, headers=headers) as answer:
                return "" if answer.status == 200 else f"{url}: {answer.status} {(await answer.text())[:200]}"
        except (TimeoutError, aiohttp.ClientError) as exc:
            return f"{url}: {exc or type(exc).__name__}"
