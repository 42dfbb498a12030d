"""The gateway's ``/v1/responses`` (+ ``GET``/``DELETE /v1/responses/{id}``) and ``/v1/messages``.

Render with the same functions as ``/v1/responses/render`` and ``/v1/messages/render``, drive the engines as chat
does (``routes.respond``: collocated or P/D, retries, aborts, the pushed SSE relay), derender with the API's
responder (``api_responders``). ``previous_response_id`` continues a stored conversation (``response_store``);
a response with ``store`` (the default) is stored once it is complete. Errors are in each API's own shape.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from render_service.apis.endpoints import anthropic_shaped, openai_shaped
from render_service.apis.errors import coded
from render_service.apis.message_memo_anthropic import decode_messages_request
from render_service.apis.message_memo_responses import decode_responses_request
from render_service.apis.messages import render_messages
from render_service.apis.messages import to_chat as messages_to_chat
from render_service.apis.messages_protocol import MessagesRequest
from render_service.apis.responses import new_response_id, render_responses
from render_service.apis.responses import to_chat as responses_to_chat
from render_service.apis.responses_output import ResponsesShape
from render_service.apis.responses_protocol import FunctionCallItem, MessageItem, ReasoningItem, ResponsesRequest
from render_service.gateway.api_responders import MessagesResponder, ResponsesResponder, ThinkingBudget
from render_service.gateway.flow import EngineCall, Gateway, plan_streams
from render_service.gateway.images import picture, prepared, with_features
from render_service.gateway.merged import open_merged
from render_service.gateway.response_limits import check_storable, check_stored_fields
from render_service.gateway.response_store import (
    MAX_ID_CHARS,
    ResponseStore,
    StoredResponse,
    StoreRefused,
    open_store,
)
from render_service.gateway.routes import collect, engine_error, fold, refuse_render_only, respond
from render_service.gateway.sse_relay import SseRelay
from render_service.gateway.tenancy import request_tenant, short_id
from render_service.http.errors import ApiError, bad_request, not_found
from render_service.http.request_io import (
    Answer,
    Handler,
    client_of,
    decode,
    endpoint,
    read_json_body,
    server_state,
)
from render_service.multimodal.markers import may_carry_images
from render_service.render.render_config import RenderConfig
from render_service.wire.message_memo import carries_image_parts
from render_service.wire.protocol import ChatCompletionRequest, GenerateRequest

logger = logging.getLogger("render_service.gateway.api_routes")
_encode = msgspec.json.Encoder().encode

def assistant_turn(output: list[Any]) -> dict[str, Any]:
    """A response's output items as the chat assistant message the next turn's prompt renders."""
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if isinstance(item, ReasoningItem):
            turn["reasoning"] = "".join(c.text for c in item.content)
        elif isinstance(item, MessageItem):
            turn["content"] += "".join(c.text for c in item.content)
        elif isinstance(item, FunctionCallItem):
            turn.setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": {
                "name": item.name, "arguments": item.arguments}})
    return turn


class StoreWriter:
    """Stores finished responses under their owner (the tenant that created them); a read of an id whose write
    is still in flight waits for it (same process). Logs show ids shortened (``short_id``)."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self.pending: dict[str, asyncio.Task[None]] = {}

    def write_soon(self, owner: str, response_id: str, stored: StoredResponse) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(self._write(owner, response_id, stored))
        self.pending[response_id] = task
        task.add_done_callback(lambda _: self.pending.pop(response_id, None))
        return task

    async def _write(self, owner: str, response_id: str, stored: StoredResponse) -> None:
        try:
            await self.store.put(owner, response_id, stored)
        except StoreRefused as exc:
            logger.warning("response %s not stored: %s", short_id(response_id), exc)
        except Exception as exc:
            logger.error("storing response %s failed: %s", short_id(response_id), type(exc).__name__)

    async def _settled(self, response_id: str) -> None:
        pending = self.pending.get(response_id)
        if pending is not None:
            await asyncio.gather(pending, return_exceptions=True)

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        await self._settled(response_id)
        return await self.store.get(owner, response_id)

    async def delete(self, owner: str, response_id: str) -> bool:
        await self._settled(response_id)
        return await self.store.delete(owner, response_id)


class PhasedRelay(SseRelay):
    """The SSE relay, continuing into the next engine call when the thinking budget ended a phase."""

    def __init__(self, *args: Any, budget: ThinkingBudget, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.budget = budget

    def on_over(self, error: Exception | None) -> None:
        if error is None and not self.complete and self.budget.next_gen is not None:
            asyncio.get_running_loop().create_task(self._next_phase())
            return
        super().on_over(error)

    async def _next_phase(self) -> None:
        gen = self.budget.take_next()
        assert gen is not None
        try:
            streams = await open_merged(self.gateway, plan_streams([gen], self.gateway.disaggregated), self.call,
                                        None)
        except Exception as exc:
            super().on_over(exc)
            return
        if self.complete:  # the client went away meanwhile
            streams.close()
            return
        self.streams = streams
        streams.start(self.on_choice, self.on_items, self.on_over)


async def _respond_phased(request: Request, gateway: Gateway, budget: ThinkingBudget,
                          responder: MessagesResponder, stream: bool) -> Response:
    """``routes.respond`` for a budgeted Messages request: one engine call per phase, one answer."""
    gateway.stats.requests += 1
    call = EngineCall(tenant=request_tenant(request, gateway))
    first = budget.first
    assert first is not None
    if not stream:
        async def phases() -> None:
            gen: GenerateRequest | None = first
            while gen is not None:
                await fold(gateway, plan_streams([gen], gateway.disaggregated), call, responder,  # type: ignore[arg-type]
                           None)
                gen = budget.take_next()
        return await collect(request, gateway, call, phases(), responder)  # type: ignore[arg-type]
    try:
        streams = await open_merged(gateway, plan_streams([first], gateway.disaggregated), call, None)
    except BaseException as exc:
        gateway.abort_soon(call)
        raise engine_error(exc) from None
    return PhasedRelay(gateway, call, streams, responder, budget=budget)  # type: ignore[arg-type,return-value]


def _engine_ready(gen: GenerateRequest) -> GenerateRequest:
    """Client kv_transfer_params are untrusted (they name hosts to read from); the budget is the gateway's."""
    if gen.kv_transfer_params is not None:
        raise bad_request("kv_transfer_params are set by the gateway, not by clients", "kv_transfer_params")
    if gen.sampling_params.thinking_token_budget is None:
        return gen
    return msgspec.structs.replace(gen, sampling_params=msgspec.structs.replace(gen.sampling_params,
                                                                                thinking_token_budget=None))


def api_gateway_routes(gateway: Gateway, config: RenderConfig) -> list[Route]:
    """/v1/responses (with its stored responses) and /v1/messages over the gateway's engines."""
    s = gateway.settings
    store = open_store(s.responses_store_path, s.responses_store_dsn, s.responses_store_max_entries,
                       s.responses_store_ttl_s, s.responses_store_max_bytes, s.responses_store_tenant_bytes)
    writer = StoreWriter(store)

    async def responses(request: Request) -> Answer:
        body = await read_json_body(request)
        queue = server_state(request).render_queue
        req = await queue.run("responses", len(body), lambda: decode_responses_request(
            body, config.message_memo) or decode(body, ResponsesRequest))
        refuse_render_only(req)
        client = client_of(request)
        check_stored_fields(req)
        storing = req.store is not False
        if storing:
            check_storable(len(body), store.tenant_bytes)
        tenant = request_tenant(request, gateway)
        history = None
        if req.previous_response_id is not None:
            if len(req.previous_response_id) > MAX_ID_CHARS:
                raise bad_request("previous_response_id is too long", "previous_response_id")
            stored = await writer.get(tenant, req.previous_response_id)  # another tenant's: not found
            if stored is None:
                raise coded(bad_request(f"Previous response with id '{req.previous_response_id}' not found.",
                                        "previous_response_id"), "previous_response_not_found")
            history = stored.history
        request_id = request.headers.get("x-request-id")
        given: ChatCompletionRequest | None = None
        pictured = None
        if may_carry_images(body) or (history is not None and carries_image_parts(history)):
            # the image path (gateway/images.py); a stored conversation's images are rendered again each turn
            given = await queue.run("responses", len(body), lambda: responses_to_chat(req, config, history))
            pictured = await picture(request, body, given, config)
        gen, chat = await queue.run("responses", len(body), lambda: render_responses(
            req, config, request_id=request_id, history=history, stateless=False,
            prepared=prepared(given, pictured) if given is not None and pictured is not None else given,
            expand_prompt=pictured.expand if pictured is not None else None, client=client))
        if given is not None and pictured is not None:
            gen, chat = with_features(gen, pictured), given  # stored with its image parts, for the next turn
        gen = _engine_ready(gen)
        # The response's id is minted here, never the client's: a client id could name (and overwrite) another
        # client's stored response. The client's id still names the engine hops (gen.request_id).
        shape = ResponsesShape(new_response_id(), req.model or config.model_name, req, len(gen.token_ids))
        on_done = _storer(writer, tenant, chat, req) if storing else None
        responder = ResponsesResponder(config, gen, chat, shape, on_done)
        response = await respond(request, gateway, [gen], responder, bool(req.stream))  # type: ignore[arg-type]
        if not req.stream and storing:
            pending = writer.pending.get(shape.response_id)
            if pending is not None:  # stored before answering: a GET or a follow-up right after finds it
                await asyncio.gather(pending, return_exceptions=True)
        return response

    async def get_response(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        tenant = request_tenant(request, gateway)
        stored = await writer.get(tenant, response_id) if len(response_id) <= MAX_ID_CHARS else None
        if stored is None:
            raise not_found(f"Response with id '{response_id}' not found.")
        return Response(bytes(stored.response), media_type="application/json")

    async def delete_response(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        tenant = request_tenant(request, gateway)
        if len(response_id) > MAX_ID_CHARS or not await writer.delete(tenant, response_id):
            raise not_found(f"Response with id '{response_id}' not found.")
        return Response(_encode({"id": response_id, "object": "response.deleted", "deleted": True}),
                        media_type="application/json")

    async def messages(request: Request) -> Answer:
        body = await read_json_body(request)
        request_id = request.headers.get("x-request-id")
        queue = server_state(request).render_queue
        if may_carry_images(body):  # the image path (gateway/images.py)
            answer = await messages_with_images(request, body, request_id)
            if answer is not None:
                return answer
        client = client_of(request)

        def render() -> tuple[MessagesRequest, GenerateRequest, ChatCompletionRequest]:
            req = decode_messages_request(body, config.message_memo) or decode(body, MessagesRequest)
            refuse_render_only(req)
            return req, *render_messages(req, config, request_id=request_id, client=client)

        req, gen, chat = await queue.run("messages", len(body), render)
        return await drive_messages(request, req, gen, chat)

    async def messages_with_images(request: Request, body: bytes, request_id: str | None) -> Answer | None:
        """A Messages request with image blocks (None: it has none after all), driven as any other."""
        queue = server_state(request).render_queue

        def convert() -> tuple[MessagesRequest, ChatCompletionRequest, int | None]:
            req = decode(body, MessagesRequest)
            refuse_render_only(req)
            return req, *messages_to_chat(req, config)

        req, chat, budget = await queue.run("messages", len(body), convert)
        pictured = await picture(request, body, chat, config)
        if pictured is None:
            return None
        gen, _ = await queue.run("messages", len(body), lambda: render_messages(
            req, config, request_id=request_id, prepared=(prepared(chat, pictured), budget),
            expand_prompt=pictured.expand, client=client_of(request)))
        return await drive_messages(request, req, with_features(gen, pictured), chat)

    async def drive_messages(request: Request, req: MessagesRequest, gen: GenerateRequest,
                             chat: ChatCompletionRequest) -> Answer:
        budget_tokens = gen.sampling_params.thinking_token_budget
        gen = _engine_ready(gen)
        model = req.model or config.model_name
        if budget_tokens is not None and config.reasoning_parser_cls is not None:
            budget = ThinkingBudget(config, gen, budget_tokens)
            responder = MessagesResponder(config, gen, chat, model, budget)
            return await _respond_phased(request, gateway, budget, responder, bool(req.stream))
        responder = MessagesResponder(config, gen, chat, model)
        return await respond(request, gateway, [gen], responder, bool(req.stream))  # type: ignore[arg-type]

    def route(path: str, name: str, handler: Handler, shaped: Callable[[Handler], Handler], methods: list[str]
              ) -> Route:
        return Route(path, endpoint(name, shaped(handler), auth=False), methods=methods)

    return [
        route("/v1/responses", "responses", responses, openai_shaped, ["POST"]),
        route("/v1/responses/{response_id}", "responses_get", get_response, openai_shaped, ["GET"]),
        route("/v1/responses/{response_id}", "responses_delete", delete_response, openai_shaped, ["DELETE"]),
        route("/v1/messages", "messages", messages, anthropic_shaped, ["POST"]),
    ]


def _storer(writer: StoreWriter, owner: str, chat: ChatCompletionRequest, req: ResponsesRequest
            ) -> Callable[[Any], asyncio.Task[None] | None]:
    """The conversation as the next turn will render it: without this request's instructions (not carried over).
    Returns the write, which a stream's last event waits for (``ResponsesResponder.before_last_write``)."""
    messages = chat.messages[1:] if req.instructions else list(chat.messages)

    def store(response: Any) -> asyncio.Task[None] | None:
        if response.status == "failed":
            return None
        history = [*messages, assistant_turn(response.output)]
        return writer.write_soon(owner, response.id, StoredResponse(msgspec.Raw(_encode(response)), history))

    return store


__all__ = ["api_gateway_routes", "ApiError"]
