"""HTTP shell of the tokens-only engine: vLLM's /inference/v1/generate, abort, health, models, metrics.

The handlers decode and validate (msgspec + validation.py), hand the request to the AsyncEngine thread and
turn its RequestUpdates into a GenerateResponse or SSE chunks. A client that goes away aborts its request,
so its blocks return to the pool.

Request ids, as vLLM: the response carries ``generate-tokens-`` + the caller's id, which need not be unique
(RL callers sample one rendered request k times; clients retry). Inside, each request runs under that id plus
``-`` and 8 random hex digits, which is also the id its KV blocks and leases go by; aborting the caller's id
aborts every request running under it and releases the KV a finished one still holds for a peer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import cast

import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from splitserve_common.auth import ApiKeyGuard, ApiKeys
from splitserve_common.output_parsers import ParserFlags, StopSpec
from splitserve_common.tenants import engine_caller
from token_engine.core.bad_words import BadWordsError
from token_engine.core.engine import AsyncEngine, RequestUpdate, SequenceDelta
from token_engine.core.model_tokenizer import TokenizerUnavailable
from token_engine.core.scheduler import GRAMMAR_VIOLATION
from token_engine.core.sequence import TokenLogprob
from token_engine.http import protocol as p
from token_engine.http.derender_output import DerenderChoices, OutputParsers, check_parse_context
from token_engine.http.protocol import error_response
from token_engine.http.request_error import RequestError
from token_engine.http.text_output import TextChoices, text_options
from token_engine.http.validation import output_mode, validate_generate_request
from token_engine.kv_connector.base import KV_LOAD_FAILED, KV_PARAMS_REFUSED
from token_engine.rl.routes import rl_control_enabled, rl_routes
from token_engine.structured import GrammarError

try:
    from importlib.metadata import version as _pkg_version

    VERSION = _pkg_version("splitserve")
except Exception:  # noqa: BLE001 - running from a source tree without metadata
    VERSION = "0.0.0"

log = logging.getLogger("token_engine.server")
LOGPROB_FLOOR = -9999.0  # what vLLM writes for -inf / NaN
MAX_REQUEST_BYTES = 64 << 20  # a 128k-token prompt is about 1 MB of JSON
JSON = "application/json"
# Engine updates one request may have waiting for its reader (one per engine step): a reader this far behind
# has stopped reading; its request is aborted instead of growing the queue while the engine keeps computing.
MAX_PENDING_UPDATES = 8192
SLOW_READER = "the client stopped reading the stream: the request was aborted"
HELD_IDS = 8192  # caller ids remembered for their held KV; a failed decode hop aborts within seconds


def _clamp(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def error_status(engine_error: str) -> int:
    """A failed KV handoff is the upstream (prefill) engine's failure: 502, not an internal error. Constraints
    that leave no token (the request's own allowed_token_ids or min_tokens against its grammar) are the
    request's fault: 400."""
    if engine_error.startswith(KV_LOAD_FAILED):
        return 502
    if engine_error.startswith(KV_PARAMS_REFUSED):  # the caller's kv_transfer_params: not the lease's
        return 400
    return 400 if engine_error == GRAMMAR_VIOLATION else 500


def encode_logprobs(entries: list[TokenLogprob], legacy: bool):
    if legacy:
        return p.ChatCompletionLogProbs(content=[
            p.LegacyTokenLogprobEntry(
                token=f"token_id:{e.token_id}", logprob=_clamp(e.logprob),
                top_logprobs=[p.LegacyTopLogprob(f"token_id:{t}", _clamp(lp)) for t, lp in e.top])
            for e in entries])
    return p.GenerateLogProbs(content=[
        p.TokenLogprobEntry(
            token_id=e.token_id, logprob=_clamp(e.logprob), rank=e.rank,
            top_logprobs=[p.TopLogprob(t, _clamp(lp), rank) for rank, (t, lp) in
                          zip(e.top_ranks or range(1, len(e.top) + 1), e.top)])
        for e in entries])


def encode_prompt_logprobs(entries: list[TokenLogprob | None]) -> list[dict[int, p.PromptLogprob] | None]:
    out: list[dict[int, p.PromptLogprob] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {t: p.PromptLogprob(_clamp(lp), rank) for rank, (t, lp) in
             zip(e.top_ranks or range(1, len(e.top) + 1), e.top)}
        d.setdefault(e.token_id, p.PromptLogprob(_clamp(e.logprob), e.rank))
        out.append(d)
    return out


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    model_path: str
    enable_prompt_tokens_details: bool = False
    default_logprobs_format: str = "ids"
    created: int = field(default_factory=lambda: int(time.time()))
    log_requests: bool = False  # --enable-log-requests: a line when each request arrives
    scheduling_policy: str | None = None  # "fcfs" refuses non-zero priorities as vLLM does
    tokens_only: bool = False  # --tokens-only: no detokenizing, so output_mode text and derender are refused
    output_parsers: OutputParsers | None = None  # derender's; None: no parser flags, no model directory to read
    running: dict[str, set[str]] = field(default_factory=dict)  # caller's id -> engine ids running under it
    # caller's id -> engine ids of finished requests whose KV the connector may still hold for a peer (P/D
    # prefill): an abort by the caller's id releases those leases too. The newest HELD_IDS only.
    holding: OrderedDict[str, set[str]] = field(default_factory=OrderedDict)

    def start(self, request_id: str) -> str:
        """A fresh engine id for a request answered as ``request_id`` (vLLM's 8-hex-digit suffix)."""
        engine_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        self.running.setdefault(request_id, set()).add(engine_id)
        return engine_id

    def end(self, request_id: str, engine_id: str) -> bool:
        """Forget a finished request; whether it was still running."""
        ids = self.running.get(request_id)
        if ids is None or engine_id not in ids:
            return False
        ids.discard(engine_id)
        if not ids:
            del self.running[request_id]
        return True

    def held_for_peer(self, request_id: str, engine_id: str) -> None:
        self.holding.setdefault(request_id, set()).add(engine_id)
        self.holding.move_to_end(request_id)
        while len(self.holding) > HELD_IDS:
            self.holding.popitem(last=False)

    def engine_ids(self, request_id: str) -> list[str]:
        """Every engine id an abort of ``request_id`` reaches: running requests, then held KV."""
        return [*self.running.get(request_id, ()), *self.holding.pop(request_id, ())]

    def load(self) -> int:
        return sum(len(ids) for ids in self.running.values())


async def _read_json(request: Request, type_, *, content_type_optional: bool = False):
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != JSON and not (content_type_optional and not ctype):
        raise RequestError("Unsupported Media Type: Only 'application/json' is allowed")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_REQUEST_BYTES):
        raise RequestError(f"request body larger than {MAX_REQUEST_BYTES} bytes", status=413)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_REQUEST_BYTES:
                raise RequestError(f"request body larger than {MAX_REQUEST_BYTES} bytes", status=413)
    except ClientDisconnect:  # the caller went away mid-upload (a gateway that aborted): not our error
        raise RequestError("client disconnected", status=499) from None
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        # vLLM's validation 400: ``param`` is the field's path in the body ("body.request_ids")
        path = str(exc).rpartition(" - at `$")[2].rstrip("`")
        raise RequestError(f"Invalid request: {exc}", param="body" + path if path != str(exc) else None) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"Invalid JSON body: {exc}") from None
    except RecursionError:  # msgspec stops at the interpreter's recursion limit (about 1000 levels)
        raise RequestError("Invalid JSON body: nested too deeply") from None


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


StreamChoice = p.GenerateStreamChoice | p.GenerateDerenderStreamChoice


class Generation:
    """One in-flight /generate call: engine updates arrive on an asyncio queue from the engine thread."""

    def __init__(self, state: ServerState, req: p.GenerateRequest, request_id: str, n: int):
        self.state = state
        self.req = req
        self.request_id = request_id  # what the caller sees
        self.engine_id = state.start(request_id)  # what the engine, its KV blocks and leases go by
        self.n = n
        self.queue: asyncio.Queue[RequestUpdate] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.started = time.monotonic()
        self.done = False
        fmt = req.logprobs_format or state.default_logprobs_format
        sp = req.sampling_params
        self.wants_logprobs = sp.logprobs is not None or sp.logprob_token_ids is not None
        self.legacy_logprobs = fmt == "token_id_strings"
        self.output_mode = output_mode(req)
        self.text: TextChoices | None = None  # text modes: set up by the handler once it has the tokenizer
        self.derender: DerenderChoices | None = None  # output_mode "derender": the choices' parsers

    def stop_early(self, index: int) -> None:
        """A stop string ended choice ``index``: the engine stops that sequence, the others go on."""
        engine_id = self.engine_id
        self.state.engine.call(lambda eng: eng.stop_sequence(engine_id, index))

    def on_update(self, update: RequestUpdate) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self._deliver, update)

    def _deliver(self, update: RequestUpdate) -> None:
        if self.done and self.queue.qsize() >= MAX_PENDING_UPDATES:
            return  # aborted as a slow reader: its error is queued already
        if self.queue.qsize() >= MAX_PENDING_UPDATES - 1 and not update.finished:
            self.abort()
            update = RequestUpdate(update.request_id, [], finished=True, error=SLOW_READER)
        self.queue.put_nowait(update)

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self.state.engine.abort_request(self.engine_id)

    def finish(self, completion_tokens: int | None = None, outcome: str = "aborted") -> None:
        self.done = True
        if self.state.end(self.request_id, self.engine_id):
            # One line per request, key=value, for log pipelines.
            log.info("request_id=%s prompt_tokens=%d completion_tokens=%s n=%d stream=%s outcome=%s ms=%.1f",
                     self.request_id, len(self.req.token_ids), completion_tokens, self.n, bool(self.req.stream),
                     outcome, (time.monotonic() - self.started) * 1e3)

    def usage(self, completion_tokens: int, cached_tokens: int) -> p.UsageInfo:
        prompt_tokens = len(self.req.token_ids)
        details = p.PromptTokensDetails(cached_tokens) if self.state.enable_prompt_tokens_details else None
        return p.UsageInfo(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, details)

    async def collect(self) -> Response:
        tokens: list[list[int]] = [[] for _ in range(self.n)]
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(self.n)]
        reasons: list[str | None] = [None] * self.n
        stop_reasons: list[int | str | None] = [None] * self.n
        spans: list[list[tuple[str, int, int]] | None] = [None] * self.n
        text_logprobs: list[list[p.LegacyTokenLogprobEntry]] = [[] for _ in range(self.n)]
        while True:
            update = await self.queue.get()
            for d in update.deltas:
                if self.text is not None:
                    step = self.text.step(d)
                    if step is None:
                        continue
                    if step.stopped_early:
                        self.stop_early(d.index)
                    tokens[d.index].extend(step.token_ids)
                    if self.wants_logprobs:
                        text_logprobs[d.index] += self.text.logprobs(step.logprobs, step.logprob_context).content or []
                    if step.finish_reason is not None:
                        reasons[d.index] = step.finish_reason
                        stop_reasons[d.index] = step.stop_reason
                        spans[d.index] = d.weight_versions
                    continue
                tokens[d.index].extend(d.token_ids)
                logprobs[d.index].extend(d.logprobs)
                if d.finish_reason is not None:
                    reasons[d.index] = d.finish_reason
                    stop_reasons[d.index] = d.stop_reason
                    spans[d.index] = d.weight_versions
            if update.finished:
                break
        if update.kv_transfer_params is not None:
            self.state.held_for_peer(self.request_id, self.engine_id)
        self.finish(sum(len(t) for t in tokens), "error" if update.error else ",".join(r or "stop" for r in reasons))
        if update.error:
            return error_response(update.error, error_status(update.error))
        choices = [
            p.GenerateResponseChoice(
                index=i, token_ids=tokens[i], finish_reason=reasons[i] or "stop", stop_reason=stop_reasons[i],
                logprobs=self.choice_logprobs(logprobs[i]), weight_versions=p.weight_versions(len(tokens[i]), spans[i]))
            for i in range(self.n)
        ]
        if self.text is not None:
            for i, choice in enumerate(choices):
                choice.text = self.text.text(i)
                choice.logprobs = p.ChatCompletionLogProbs(text_logprobs[i]) if self.wants_logprobs else None
        if self.derender is not None:
            try:
                return self.derender_response(choices, update)
            except RequestError as exc:
                return error_response(exc.message, exc.status, exc.param)
        body = p.GenerateResponse(
            request_id=self.request_id, model=self.state.model_name, created=int(time.time()), choices=choices,
            usage=self.usage(sum(len(t) for t in tokens), update.num_cached_tokens),
            prompt_logprobs=encode_prompt_logprobs(update.prompt_logprobs) if update.prompt_logprobs else None,
            kv_transfer_params=update.kv_transfer_params, output_mode=self.output_mode,
        )
        if self.req.return_token_ids:
            body.prompt_token_ids = self.req.token_ids
        return Response(msgspec.json.encode(body), media_type=JSON)

    def derender_response(self, choices: list[p.GenerateResponseChoice], update: RequestUpdate) -> Response:
        """Text mode's choices as parsed messages (RequestError when a parser refuses the context)."""
        derender = self.derender
        assert derender is not None
        hide = derender.hides_metadata
        parsed = []
        for c in choices:
            message, finish_reason = derender.message(c.index, c.token_ids, str(c.text), c.finish_reason)
            parsed.append(p.GenerateDerenderChoice(
                index=c.index, token_ids=None if hide else c.token_ids, finish_reason=finish_reason,
                stop_reason=c.stop_reason, logprobs=None if hide else cast(p.ChatCompletionLogProbs | None, c.logprobs),
                weight_versions=c.weight_versions, message=message))
        body = p.GenerateDerenderResponse(
            request_id=self.request_id, model=self.state.model_name, created=int(time.time()), choices=parsed,
            usage=self.usage(sum(len(c.token_ids) for c in choices), update.num_cached_tokens),
            prompt_logprobs=encode_prompt_logprobs(update.prompt_logprobs) if update.prompt_logprobs else None,
            kv_transfer_params=update.kv_transfer_params)
        if self.req.return_token_ids:
            body.prompt_token_ids = self.req.token_ids
        return Response(msgspec.json.encode(body), media_type=JSON)

    def choice_logprobs(self, entries: list[TokenLogprob]):
        want_top = self.wants_logprobs
        if not self.req.return_token_logprobs:
            return encode_logprobs(entries, self.legacy_logprobs) if want_top else None
        # vLLM's fast path: just the sampled tokens' logprobs, as a flat list (streamed: this chunk's tokens').
        out = encode_logprobs(entries, legacy=False) if want_top else p.GenerateLogProbs(content=None)
        out.sampled = [_clamp(e.logprob) for e in entries]
        return out

    def stream_choice(self, d: SequenceDelta) -> tuple[StreamChoice | None, int]:
        """One delta as a stream event's choice (None: nothing to send for it) and the tokens it counts."""
        if self.text is None:
            return p.GenerateStreamChoice(index=d.index, token_ids=d.token_ids, finish_reason=d.finish_reason,
                                          stop_reason=d.stop_reason, logprobs=self.choice_logprobs(d.logprobs)), \
                len(d.token_ids)
        step = self.text.step(d)
        if step is None:
            return None, 0
        if step.stopped_early:
            self.stop_early(d.index)
        logprobs = self.text.logprobs(step.logprobs, step.logprob_context) if self.wants_logprobs else None
        count = len(step.token_ids)
        if self.derender is None:
            return p.GenerateStreamChoice(index=d.index, token_ids=step.token_ids, finish_reason=step.finish_reason,
                                          stop_reason=step.stop_reason, logprobs=logprobs, text=step.text), count
        delta, finish_reason = self.derender.step(d.index, step.token_ids, step.text, step.finish_reason)
        hide = self.derender.hides_metadata
        token_ids = None if hide else step.token_ids
        logprobs = None if hide else logprobs
        if not delta and finish_reason is None and not token_ids and not (logprobs and logprobs.content):
            return None, count  # as vLLM: a derender event with nothing in it is not sent
        return p.GenerateDerenderStreamChoice(index=d.index, token_ids=token_ids, finish_reason=finish_reason,
                                              stop_reason=step.stop_reason, logprobs=logprobs, delta=delta), count

    def stream_event(self, choices: list[StreamChoice], kv_transfer_params: dict | None = None
                     ) -> p.GenerateStreamResponse | p.GenerateDerenderStreamResponse:
        if self.derender is not None:
            event = p.GenerateDerenderStreamResponse(request_id=self.request_id,
                                                     choices=cast(list[p.GenerateDerenderStreamChoice], choices))
            if kv_transfer_params is not None:
                event.kv_transfer_params = kv_transfer_params
            return event
        plain = cast(list[p.GenerateStreamChoice], choices)
        if kv_transfer_params is not None:
            # the caller learns what is held for it only from the final event (as non-streaming)
            return p.GenerateStreamEndResponse(request_id=self.request_id, choices=plain,
                                               kv_transfer_params=kv_transfer_params, output_mode=self.output_mode)
        return p.GenerateStreamResponse(request_id=self.request_id, choices=plain, output_mode=self.output_mode)

    async def stream(self):
        opts = self.req.stream_options
        include_usage = bool(opts is not None and opts.include_usage)
        continuous = bool(opts is not None and opts.continuous_usage_stats)
        counts = [0] * self.n
        first = True
        try:
            while True:
                update = await self.queue.get()
                if update.error:
                    yield b"data: " + p.error_body(update.error, error_status(update.error)) + b"\n\n"
                    self.finish(sum(counts), "error")
                    break
                failed = None
                for d in update.deltas:
                    try:
                        choice, count = self.stream_choice(d)
                    except Exception as exc:  # noqa: BLE001 - a parser bug ends the stream with an error event
                        log.exception("output_mode %s failed on request_id=%s", self.output_mode, self.request_id)
                        failed = f"internal error: {type(exc).__name__}"
                        break
                    counts[d.index] += count
                    if choice is None:
                        continue
                    if choice.finish_reason is not None:
                        choice.weight_versions = p.weight_versions(counts[d.index], d.weight_versions)
                    last = update.kv_transfer_params is not None and d is update.deltas[-1]
                    chunk = self.stream_event([choice], update.kv_transfer_params if last else None)
                    if continuous:
                        chunk.usage = self.usage(counts[d.index], update.num_cached_tokens)
                    if first and self.req.return_token_ids:
                        chunk.prompt_token_ids = self.req.token_ids
                    first = False
                    yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
                if failed is not None:
                    yield b"data: " + p.error_body(failed, 500) + b"\n\n"
                    self.abort()
                    self.finish(sum(counts), "error")
                    break
                if update.finished:
                    if update.kv_transfer_params is not None:
                        self.state.held_for_peer(self.request_id, self.engine_id)
                    self.finish(sum(counts), "finished")
                    if include_usage:
                        chunk = self.stream_event([])
                        chunk.usage = self.usage(sum(counts), update.num_cached_tokens)
                        yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
                    break
            self.done = True
            yield b"data: [DONE]\n\n"
        finally:
            self.abort()  # no-op when finished; a client that went away lands here with the request live
            self.finish()


class GenerationStream(StreamingResponse):
    """SSE response that aborts its request however the response ends (even before the body started)."""

    def __init__(self, gen: Generation):
        super().__init__(gen.stream(), media_type="text/event-stream")
        self.generation = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.abort()
            self.generation.finish()


async def _set_up_text(state: ServerState, gen: Generation) -> Response | None:
    """The tokenizer a text mode needs (loaded off the event loop the first time), or vLLM's 400."""
    mode = gen.output_mode
    why = "--tokens-only" if state.tokens_only else None
    if why is None:
        try:
            tokenizer = await asyncio.to_thread(state.engine.engine.tokenizer.get)
        except TokenizerUnavailable as exc:
            why = str(exc)
    if why is not None:
        return error_response(f"output_mode={mode!r} requires a tokenizer, but this server does not load one "
                              f"({why}). Send the request to a server that loads a tokenizer, or use "
                              f"output_mode='tokens'.", 400, "output_mode")
    gen.text = TextChoices(tokenizer, gen.req.token_ids, text_options(gen.req.sampling_params), gen.n)
    if mode == "derender":
        try:
            gen.derender = await _derender_choices(state, gen)
        except RequestError as exc:
            return error_response(exc.message, exc.status, exc.param)
    return None


async def _derender_choices(state: ServerState, gen: Generation) -> DerenderChoices:
    """The choices' parsers (loaded off the event loop the first time), or RequestError as vLLM's checks."""
    context = check_parse_context(gen.req.parse_context, "derender")
    parsers = state.output_parsers
    impl = None
    if parsers is not None and parsers.flags.has_parsers:
        if context is None:
            raise RequestError("output_mode='derender' requires parse_context on a server with a tool or reasoning "
                               "parser. Use the one returned by /render.", "parse_context")
        impl = await asyncio.to_thread(parsers.get)
    options = text_options(gen.req.sampling_params)
    stop = StopSpec(options.stop, options.include_stop_str_in_output, options.min_tokens) if options.stop else None
    return await asyncio.to_thread(DerenderChoices, impl, context, gen.req.token_ids, gen.request_id, gen.n,
                                   bool(gen.req.stream), stop)


def _caller(request: Request) -> str:
    """Who this request's budgets charge: the gateway's tenant from an authenticated caller, else the peer."""
    return engine_caller(request.scope, request.headers, request.client.host if request.client else None)


async def generate(request: Request) -> Response:
    state: ServerState = request.app.state.server
    try:
        req = await _read_json(request, p.GenerateRequest)
        if req.model is not None and req.model != state.model_name:
            return error_response(f"The model `{req.model}` does not exist.", 404, "model")
        options, n = validate_generate_request(req, state.engine.engine.limits)
        if req.sampling_params.bad_words:  # loading and tokenizing: off the event loop
            bad_words = await asyncio.to_thread(state.engine.engine.bad_words.token_ids, req.sampling_params.bad_words)
            options = dataclasses.replace(options, bad_words_token_ids=bad_words)
        if options.structured is not None:  # compiled here, off the engine thread, in bounded time
            client = _caller(request)  # compile caps are per tenant (per peer without one)
            grammar = await state.engine.engine.grammars.compile_async(options.structured, client)
            options = dataclasses.replace(options, grammar=grammar)
    except RequestError as exc:
        return error_response(exc.message, exc.status, exc.param)
    except GrammarError as exc:  # 400; 429 over a compile cap; 503 while shutting down
        return error_response(exc.message, exc.status, exc.param)
    except BadWordsError as exc:
        return error_response(str(exc), 400, "sampling_params.bad_words")
    if req.return_token_logprobs and state.engine.engine.config.logprobs_mode == "raw_logits":
        return error_response("return_token_logprobs needs --logprobs-mode raw_logprobs (the server runs "
                              "raw_logits)", 400, "return_token_logprobs")
    if req.priority != 0 and state.scheduling_policy == "fcfs":
        return error_response(f"Got priority {req.priority} but Priority scheduling is not enabled.", 400,
                              "priority")
    if not state.engine.is_alive():
        return error_response("the engine is not running", 503)
    if state.engine.refusal is not None:  # paused for a weight update (abort/wait) or asleep
        return error_response(state.engine.refusal, 503)
    suffix = request.headers.get("x-request-id") or req.request_id or uuid.uuid4().hex
    gen = Generation(state, req, p.REQUEST_ID_PREFIX + suffix, n)
    if gen.output_mode != "tokens":
        refusal = await _set_up_text(state, gen)
        if refusal is not None:
            gen.finish(0, "refused")
            return refusal
    if state.log_requests:
        log.info("received request_id=%s engine_id=%s prompt_tokens=%d n=%d stream=%s sampling_params=%s",
                 gen.request_id, gen.engine_id, len(req.token_ids), n, bool(req.stream),
                 msgspec.json.encode(req.sampling_params).decode())
    caller = _caller(request)
    state.engine.add_request(gen.engine_id, req.token_ids, options, n, req.priority, req.cache_salt,
                             req.kv_transfer_params, gen.on_update, caller=caller)
    if req.stream:
        return GenerationStream(gen)

    collect = asyncio.ensure_future(gen.collect())
    disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not collect.done():
            gen.abort()
            gen.finish()
            collect.cancel()
        disconnect.cancel()
    if collect.cancelled():
        return error_response("client disconnected", 499)
    return collect.result()


async def abort_requests(request: Request) -> Response:
    state: ServerState = request.app.state.server
    try:
        # vLLM 0.34 still accepts an abort without a Content-Type
        body = await _read_json(request, p.AbortRequest, content_type_optional=True)
    except RequestError as exc:
        return error_response(exc.message, exc.status, exc.param)
    for rid in body.ids():
        # The id the response carried, or the caller's own (header or body); every request running under
        # it ends (duplicates included), and an engine id aborts just its request.
        names = (rid,) if rid.startswith(p.REQUEST_ID_PREFIX) else (rid, p.REQUEST_ID_PREFIX + rid)
        for name in names:
            for engine_id in state.engine_ids(name):
                state.engine.abort_request(engine_id)
        state.engine.abort_request(rid)
    return Response(status_code=200)


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return Response(status_code=200 if state.engine.is_alive() else 503)


async def load(request: Request) -> Response:
    """vLLM's GET /load: generate requests in flight (always tracked here)."""
    state: ServerState = request.app.state.server
    return JSONResponse({"server_load": state.load()})


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    eng = state.engine.engine
    return JSONResponse({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "splitserve",
        "root": state.model_path, "parent": None, "max_model_len": eng.max_model_len,
    }]})


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    from prometheus_client import CONTENT_TYPE_LATEST

    eng = state.engine.engine
    connector_metrics = getattr(eng.connector, "render_metrics", None)  # KV transfer metrics (P/D), if any
    body = eng.metrics.render() + (connector_metrics() if connector_metrics else b"")
    return Response(body, media_type=CONTENT_TYPE_LATEST)


async def version(request: Request) -> Response:
    return JSONResponse({"version": VERSION})


async def kv_cache_debug(request: Request) -> Response:
    """Block accounting, for tests and operators: num_free_blocks returns to num_blocks when idle."""
    state: ServerState = request.app.state.server
    eng = state.engine.engine
    bm = eng.block_manager
    return JSONResponse({
        "num_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks(), "block_size": bm.block_size,
        "num_running": len(eng.scheduler.running), "num_waiting": len(eng.scheduler.waiting),
        "num_held_by_connector": len(eng.scheduler.held_by_connector),
        "prefix_cache_queries": bm.prefix_queries, "prefix_cache_hits": bm.prefix_hits,
        "num_preemptions": eng.scheduler.num_preemptions,
    })


async def _not_found(request: Request, exc) -> Response:
    return error_response(f"{request.url.path} not found", 404)


async def _method_not_allowed(request: Request, exc) -> Response:
    return error_response(f"method {request.method} not allowed on {request.url.path}", 405)


def _guarded(handler):
    """A bug in a handler still answers with the error envelope (and keeps the connection usable)."""

    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:  # noqa: BLE001
            log.exception("unhandled error on %s", request.url.path)
            return error_response(f"internal error: {type(exc).__name__}", 500)

    return guarded


UNAUTHORIZED_BODY = p.error_body("Unauthorized: missing or invalid API key", 401, type_="UnauthorizedError")


def build_app(engine: AsyncEngine, model_name: str, model_path: str, enable_prompt_tokens_details: bool = False,
              default_logprobs_format: str = "ids", *, log_requests: bool = False,
              scheduling_policy: str | None = None, api_keys: ApiKeys | None = None,
              rl_control: bool | None = None, tokens_only: bool = False,
              parser_flags: ParserFlags | None = None) -> Starlette:
    """The engine's app; with ``api_keys``, every path but the public ones (auth.PUBLIC_PATHS) needs one.
    ``rl_control`` (default: VLLM_SERVER_DEV_MODE=1, as vLLM) adds the trainer routes of token_engine/rl."""

    routes = [*(rl_routes(_guarded) if rl_control_enabled(rl_control) else []),
        Route("/inference/v1/generate", _guarded(generate), methods=["POST"]),
        Route("/inference/v1/abort_requests", _guarded(abort_requests), methods=["POST"]),
        Route("/abort_requests", _guarded(abort_requests), methods=["POST"]),
        Route("/health", _guarded(health), methods=["GET"]),
        Route("/ping", _guarded(health), methods=["GET", "POST"]),  # SageMaker's health check, as vLLM
        Route("/load", _guarded(load), methods=["GET"]),
        Route("/v1/models", _guarded(models), methods=["GET"]),
        Route("/metrics", _guarded(metrics), methods=["GET"]),
        Route("/version", _guarded(version), methods=["GET"]),
        Route("/debug/kv_cache", _guarded(kv_cache_debug), methods=["GET"]),
    ]
    guard = [Middleware(ApiKeyGuard, keys=api_keys, unauthorized_body=UNAUTHORIZED_BODY)] if api_keys else []
    app = Starlette(routes=routes, middleware=guard,
                    exception_handlers={404: _not_found, 405: _method_not_allowed})
    app.state.server = ServerState(engine, model_name, model_path, enable_prompt_tokens_details,
                                   default_logprobs_format, log_requests=log_requests,
                                   scheduling_policy=scheduling_policy, tokens_only=tokens_only,
                                   # derender's parsers read the tokenizer's directory (--tokenizer, else the model)
                                   output_parsers=OutputParsers(engine.engine.config.tokenizer or
                                                                engine.engine.config.model,
                                                                parser_flags or ParserFlags()))
    return app
