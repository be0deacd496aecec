"""vLLM's runtime LoRA endpoints, on with `--enable-lora-runtime-updates` (vLLM gates them with an
environment variable): `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}` checks the PEFT folder
here (its config and its tensors' names, `shared.lora.check_adapter`), gives the name the next adapter
index and sends the load on the requests' path (`shared.messages.AdapterUpdate`), so that a request sent
after the answer runs on it; `POST /v1/unload_lora_adapter` `{"lora_name"}` answers a new request naming it
with 404 at once, while the requests in flight finish on its weights and the worker frees them after
the last (`procs.scheduler.adapter_updates`). Under `/v1/`, so with API keys they need one. A name loaded
again is a new index: its prefix cache never serves the old weights' KV.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from procs.api.errors import error_response
from procs.api.schemas import LoadLoraBody, UnloadLoraBody, decode_body
from shared.errors import ModelLoadError, Refusal
from shared.lora import check_adapter
from shared.messages import AdapterUpdate


def add_lora_routes(app: web.Application, handlers) -> None:
    """Register the two endpoints on the api's application (`handlers`: its `ApiHandlers`)."""
    routes = _LoraRoutes(handlers)
    app.router.add_post("/v1/load_lora_adapter", routes.load)
    app.router.add_post("/v1/unload_lora_adapter", routes.unload)


class _LoraRoutes:
    def __init__(self, handlers) -> None:
        self.handlers = handlers
        self.lock = asyncio.Lock()  # one update at a time: a name is checked and taken together

    async def load(self, request: web.Request) -> web.Response:
        try:
            body = decode_body(await self.handlers._read_body(request), LoadLoraBody)
            async with self.lock:
                served = self.handlers.served
                served.check_free(body.lora_name)
                try:
                    await asyncio.to_thread(check_adapter, body.lora_path, self.handlers.config.max_lora_rank)
                except ModelLoadError as exc:
                    raise Refusal(str(exc), "lora_path") from None
                index = served.load(body.lora_name)
                try:
                    await self.handlers.engine.update_adapter(AdapterUpdate(index=index, name=body.lora_name,
                                                                            path=body.lora_path))
                except Refusal:
                    served.unload(body.lora_name)  # never sent: not served
                    raise
        except Refusal as exc:
            return error_response(exc.status, exc.message, exc.param, exc.code)
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        try:
            body = decode_body(await self.handlers._read_body(request), UnloadLoraBody)
            async with self.lock:
                index = self.handlers.served.unload(body.lora_name)
                await self.handlers.engine.update_adapter(AdapterUpdate(index=index, name=body.lora_name))
        except Refusal as exc:
            return error_response(exc.status, exc.message, exc.param, exc.code)
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
