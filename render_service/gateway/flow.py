"""Request flows over the engine pools: collocated (one generate call) and disaggregated (prefill, then decode).

Every engine call streams, whatever the client asked for: stop strings and client disconnects can then
end the generation early, and a replica that dies before its first event can be swapped for another
(``retries`` more attempts, each on a replica not tried yet). Once an event has reached the caller the
flow is committed to that replica, and a failure surfaces as ``EngineStreamBroken``.

Disaggregated, as vLLM's toy P/D proxy but over /inference/v1/generate: the prefill call is not
streamed, asks for one token (``max_tokens = 1``, no ``min_tokens``) and sets
``kv_transfer_params.do_remote_decode``; the decode call carries the kv_transfer_params prefill
returned (plus ``prompt_token_ids``, so decode can check it pulls KV for the same prompt). Both
hops share the X-Request-Id. Prefill replicas are chosen by prefix affinity, decode by load.

A request that wants its prompt's logprobs (``prompt_logprobs``, or completions ``echo`` with ``logprobs``) is one
non-streamed call: no engine streams prompt logprobs (vLLM's generate returns them only in a whole response). In
P/D it goes to a decode replica alone (an engine computes the prompt it was given; a decode that pulled its KV
has no logits for it). Its events are the response's choices, replayed as one batch (``WholeResponse``).

The X-Request-Id sent to engines is the rendered request id plus 8 hex digits of the client request
(``EngineCall.tag``): clients may send one id on concurrent requests (RL sampling, retries), engines abort
every request under an id, and one client going away must abort its own engine requests only. A rendered
id that is not header-safe (a client's body ``request_id`` may be any printable text) is replaced by a
digest of it (``splitserve_common.request_ids``): no client byte reaches an engine header.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from render_service.gateway import metrics
from render_service.gateway.conversations import (
    DEFAULT_CAPACITY,
    DEFAULT_TTL_S,
    ConversationCache,
    HeldTurn,
    next_turn_prefill_params,
    preferred_replica,
    prefill_fell_back,
)
from render_service.gateway.engine_client import (
    EngineClient,
    EngineEvents,
    EngineRejected,
    EngineStreamBroken,
    EngineUnavailable,
)
from render_service.gateway.pd import PrefixRecord, kv_identity, push_decode_params
from render_service.gateway.pools import Replica, ReplicaPool, prefix_key
from render_service.wire.protocol import (
    GenerateRequest,
    GenerateResponse,
    GenerateStreamChoice,
    GenerateStreamResponse,
    SamplingParams,
    StreamOptions,
)
from splitserve_common.request_ids import engine_header_id

logger = logging.getLogger("render_service.gateway.flow")

ENGINE_REQUEST_PREFIX = "generate-tokens-"  # what tokens-only engines prepend to the X-Request-Id
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}

_encode = msgspec.json.Encoder().encode


@dataclass
class GatewaySettings:
    block_size: int = 16  # the engines' KV block size: prefix affinity hashes whole blocks
    affinity_blocks: int = 4  # how many leading blocks key the prefix affinity
    retries: int = 2  # further attempts, each on another replica, before the first event
    load_factor: float = 1.25  # prefix affinity yields once a replica carries this times the mean load
    cooldown_s: float = 5.0  # a failed replica is passed over this long
    dns_refresh_s: float = 10.0
    conversation_ttl_s: float = DEFAULT_TTL_S  # decode's held KV kept per conversation_id (P/D), this long
    max_conversations: int = DEFAULT_CAPACITY
    pd_transfer_mode: str = "pull"  # "push": both legs at once (engines run NixlPushConnector)
    pd_min_uncached_tokens: int = 0  # below this many uncached prompt tokens (estimated), decode alone serves
    max_num_seqs: int = 256  # the engines' --max-num-seqs: P/D refuses n above it, as a collocated engine does
    # stored Responses (gateway/response_store.py): SQLite at this path (None: the cache directory), or PostgreSQL
    responses_store_path: str | None = None
    responses_store_dsn: str | None = None
    responses_store_max_entries: int = 100_000
    responses_store_ttl_s: float = 30 * 24 * 3600.0
    responses_store_max_bytes: int = 1 << 30  # all stored responses together
    responses_store_tenant_bytes: int = 64 << 20  # one tenant's stored responses together
    tenant_header: str | None = None  # an authenticated proxy's header naming its client (tenants.py)


@dataclass
class GatewayStats:
    requests: int = 0
    retries: int = 0
    engine_failures: int = 0
    aborts: int = 0
    stream_errors: int = 0
    slow_client_waits: int = 0  # a streaming client fell behind and its engine reads were paused


@dataclass
class EngineCall:
    """The engine requests one client request has in flight, so that they can be aborted."""

    live: dict[str, str] = field(default_factory=dict)  # engine request id (before the tag) -> replica url
    conversation: bytes | None = None  # key of the client's conversation_id (P/D multi-turn KV reuse)
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])  # tells this call's engine requests apart
    tenant: str | None = None  # whom the engines charge (splitserve_common/tenants.py), sent on every hop

    def wire_id(self, rid: str) -> str:
        """The X-Request-Id an engine request goes by: unique to this client request, and never client bytes
        that are not header-safe (a digest stands in for those)."""
        return f"{engine_header_id(rid)}-{self.tag}"

    def take(self, request_id: str | None = None) -> list[tuple[str, list[str]]]:
        """(url, engine ids) to abort: every live call, or those of one rendered prompt; forgets them."""
        out = []
        for rid, url in list(self.live.items()):
            if request_id is None or rid == request_id or rid.startswith(request_id + "-retry"):
                wire = self.wire_id(rid)
                out.append((url, [ENGINE_REQUEST_PREFIX + wire, wire]))
                del self.live[rid]
        return out


class NoReplica(Exception):
    """Every attempt failed or no replica was left to try."""


def _retrieve(task: asyncio.Future[Any]) -> None:
    """A leg we no longer wait for: its failure was handled (or does not matter); keep asyncio quiet."""
    if not task.cancelled():
        task.exception()


class Gateway:
    def __init__(self, *, engines: list[str] | None = None, prefill: list[str] | None = None,
                 decode: list[str] | None = None, settings: GatewaySettings | None = None,
                 client: EngineClient | None = None) -> None:
        self.settings = s = settings or GatewaySettings()
        if engines and (prefill or decode):
            raise ValueError("give either --engine (collocated) or --prefill and --decode (disaggregated), not both")
        if bool(prefill) != bool(decode):
            raise ValueError("disaggregated serving needs both --prefill and --decode")
        if not engines and not prefill:
            raise ValueError("the gateway needs --engine, or --prefill and --decode")
        if s.pd_transfer_mode not in ("pull", "push") or s.pd_min_uncached_tokens < 0:
            raise ValueError("--pd-transfer-mode is pull or push; --pd-min-uncached-tokens >= 0")
        if s.block_size < 1 or s.affinity_blocks < 0 or s.retries < 0 or s.load_factor < 1 or s.max_num_seqs < 1:
            raise ValueError("gateway settings out of range (block size >= 1, retries >= 0, load factor >= 1, "
                             "max num seqs >= 1)")
        self.disaggregated = bool(prefill)

        def pool(name: str, urls: list[str]) -> ReplicaPool:
            return ReplicaPool(name, list(urls), load_factor=s.load_factor, cooldown_s=s.cooldown_s,
                               refresh_interval_s=s.dns_refresh_s)

        self.pools = {"prefill": pool("prefill", prefill), "decode": pool("decode", decode or [])} if prefill \
            else {"engine": pool("engine", engines or [])}
        self.client = client or EngineClient()
        self.stats = GatewayStats()
        self.conversations = ConversationCache(s.max_conversations, s.conversation_ttl_s)
        self._background: set[asyncio.Task[Any]] = set()
        self.prefixes = PrefixRecord(s.block_size)  # what each decode replica was sent (conditional P/D)
        self.kv_identities: dict[str, tuple[str, str, int]] = {}  # prefill url -> its KV side channel (push)

    @property
    def mode(self) -> str:
        return "disaggregated" if self.disaggregated else "collocated"

    # ------------------------------------------------------------------------------------- events

    async def open(self, gen: GenerateRequest, call: EngineCall) -> LiveStream | WholeResponse:
        """The engine stream for one rendered prompt, with its first events read: retried on other replicas
        until an engine delivers them, committed to that replica after."""
        for p in self.pools.values():
            p.maybe_refresh()
        key = prefix_key(gen.token_ids, self.settings.block_size, self.settings.affinity_blocks)
        if gen.sampling_params.prompt_logprobs is not None:
            return await self._whole(gen, key, call)
        stream_body = _encode(engine_request(gen))
        tried: dict[str, set[str]] = {name: set() for name in self.pools}
        last_error: Exception | None = None
        held = self.conversations.take(call.conversation) if self.disaggregated and call.conversation else None
        request_id = gen.request_id or ""  # render names every request
        for attempt in range(1 + self.settings.retries):
            rid = request_id if attempt == 0 else f"{request_id}-retry{attempt}"
            if attempt:
                self.stats.retries += 1
                metrics.RETRIES.inc()
            try:
                if self.disaggregated:
                    turn, held = held, None  # a held lease is offered to one prefill attempt only
                    return await self._disaggregated(gen, rid, key, tried, call, turn, stream_body)
                return await self._start("engine", key, stream_body, rid, tried["engine"], call)
            except EngineUnavailable as exc:
                last_error = exc
                logger.warning("engine attempt %d for %s failed: %s", attempt + 1, gen.request_id, exc)
            except NoReplica as exc:
                last_error = last_error or exc  # what the replicas said beats "all were tried"
                break
        raise NoReplica(f"no engine replica could serve the request ({last_error})")

    async def _whole(self, gen: GenerateRequest, key: int | None, call: EngineCall) -> WholeResponse:
        """One non-streamed generate call (prompt logprobs), retried on other replicas while they fail."""
        pool = self.pools["decode" if self.disaggregated else "engine"]
        body = _encode(whole_request(gen))
        tried: set[str] = set()
        last_error: Exception | None = None
        request_id = gen.request_id or ""  # render names every request
        for attempt in range(1 + self.settings.retries):
            rid = request_id if attempt == 0 else f"{request_id}-retry{attempt}"
            try:
                replica = self._pick(pool, key, tried)
            except NoReplica as exc:
                last_error = last_error or exc
                break
            pool.acquire(replica)
            call.live[rid] = replica.url
            try:
                response = await self.client.generate(replica.url, body, call.wire_id(rid), call.tenant)
            except EngineUnavailable as exc:
                self._failed(pool, replica)
                last_error = exc
                logger.warning("engine attempt %d for %s failed: %s", attempt + 1, gen.request_id, exc)
                continue
            finally:
                pool.release(replica)
                call.live.pop(rid, None)
            pool.mark_ok(replica)
            return WholeResponse(response)
        raise NoReplica(f"no engine replica could serve the request ({last_error})")

    async def _disaggregated(self, gen: GenerateRequest, rid: str, key: int | None, tried: dict[str, set[str]],
                             call: EngineCall, turn: HeldTurn | None, stream_body: bytes) -> LiveStream:
        """Decode alone when little of the prompt is uncached there; else prefill then decode (pull), or both
        legs at once (push: decode reserves and registers its blocks while prefill computes)."""
        s = self.settings
        conditional = s.pd_min_uncached_tokens > 0
        decode = self._pick(self.pools["decode"], key if conditional else None, tried["decode"],
                            turn.decode_url if turn else None, mark=False)  # marked tried when it fails
        hashes = self.prefixes.chain(gen.token_ids) if conditional else []
        if conditional and len(gen.token_ids) - self.prefixes.cached_tokens(decode.url, hashes) \
                < s.pd_min_uncached_tokens:
            metrics.PD_DECISIONS.labels(path="decode_only").inc()
            try:
                live = await self._start("decode", None, stream_body, rid, tried["decode"], call, replica=decode)
            except EngineUnavailable:
                tried["decode"].add(decode.url)
                raise
            self.prefixes.record(decode.url, hashes)
            return live
        prefill = self._pick(self.pools["prefill"], key, tried["prefill"])
        identity = self.kv_identities.get(prefill.url) if s.pd_transfer_mode == "push" else None
        if identity is not None:
            metrics.PD_DECISIONS.labels(path="push").inc()
            live = await self._push(gen, rid, prefill, decode, identity, call, turn, tried["decode"])
        else:  # pull, or push before this prefill replica's side channel is known (its first response says)
            metrics.PD_DECISIONS.labels(path="pull").inc()
            kv, prid = await self._prefill(gen, rid, prefill, call, turn)
            live = await self._decode(_encode(decode_request(gen, kv)), rid, decode, prefill, prid, call,
                                     tried["decode"])
        if conditional:
            self.prefixes.record(decode.url, hashes)
        return live

    async def _push(self, gen: GenerateRequest, rid: str, prefill: Replica, decode: Replica,
                    identity: tuple[str, str, int], call: EngineCall, turn: HeldTurn | None,
                    tried: set[str]) -> LiveStream:
        """Both legs at once; whichever fails first before decode's first event ends the other."""
        prid = f"{rid}-prefill"  # both are live together: call.live needs distinct ids
        body = _encode(decode_request(gen, push_decode_params(identity, ENGINE_REQUEST_PREFIX + call.wire_id(prid))))
        p_task = asyncio.ensure_future(self._prefill(gen, prid, prefill, call, turn, keep_rid=True))
        d_task = asyncio.ensure_future(self._decode(body, rid, decode, prefill, prid, call, tried))
        try:
            await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            failed = p_task.exception() if p_task.done() else None
            if failed is not None and not d_task.done():
                self.kv_identities.pop(prefill.url, None)  # maybe restarted elsewhere: learn it again
                d_task.cancel()  # closes decode's stream: it withdraws its reservation
                await asyncio.gather(d_task, return_exceptions=True)
                raise failed
            live = await d_task
        except BaseException:
            p_task.add_done_callback(_retrieve)
            if d_task.done() and not d_task.cancelled() and d_task.exception() is not None:
                # decode failed: once prefill is done, release what it holds for the reservation at once
                wire = call.wire_id(prid)
                p_task.add_done_callback(lambda _: self._abort_later(prefill.url, [ENGINE_REQUEST_PREFIX + wire, wire]))
            elif not p_task.done():
                p_task.cancel()
            raise
        self._background.add(p_task)  # prefill's response (after its push) only tells us its identity
        p_task.add_done_callback(self._background.discard)
        p_task.add_done_callback(_retrieve)
        return live

    async def _decode(self, body: bytes, rid: str, decode: Replica, prefill: Replica, prid: str,
                      call: EngineCall, tried: set[str]) -> LiveStream:
        """The decode leg; if it fails before its first event, the prefill's held KV is released at once
        (not at lease expiry) and the error names decode."""
        try:
            return await self._start("decode", None, body, rid, tried, call, replica=decode)
        except EngineUnavailable as exc:
            tried.add(decode.url)
            self._abort_later(prefill.url, [ENGINE_REQUEST_PREFIX + call.wire_id(prid), call.wire_id(prid)])
            raise EngineUnavailable(f"decode replica failed: {exc}") from None
        except EngineRejected as exc:  # decode refused the request: nobody will pull what prefill holds for it
            self._abort_later(prefill.url, [ENGINE_REQUEST_PREFIX + call.wire_id(prid), call.wire_id(prid)])
            if exc.param() == "kv_transfer_params":  # prefill's params, not the client's: the fleet is mismatched
                raise EngineStreamBroken(f"decode replica {decode.url} refused prefill {prefill.url}'s "
                                         f"kv_transfer_params: {exc.message()}") from None
            raise

    async def _prefill(self, gen: GenerateRequest, rid: str, replica: Replica, call: EngineCall,
                       held: HeldTurn | None = None, keep_rid: bool = False) -> tuple[dict[str, Any], str]:
        """The prefill leg: (its kv_transfer_params, the request id it ran under)."""
        pool = self.pools["prefill"]
        pool.acquire(replica)
        call.live[rid] = replica.url
        reuse = next_turn_prefill_params(held) if held is not None else None  # pull the conversation's last turn
        try:
            try:
                response = await self.client.generate(replica.url, _encode(prefill_request(gen, reuse)),
                                                      call.wire_id(rid), call.tenant)
            except (EngineUnavailable, EngineRejected) as exc:
                if reuse is None:
                    raise
                retry_rid = prefill_fell_back(call, rid, replica.url, exc)  # reuse failed: recompute, same replica
                if keep_rid:  # push: decode registered for this id (the failed request has ended)
                    call.live[rid] = call.live.pop(retry_rid)
                else:
                    rid = retry_rid
                response = await self.client.generate(replica.url, _encode(prefill_request(gen)), call.wire_id(rid),
                                                      call.tenant)
        except EngineUnavailable:
            self._failed(pool, replica)
            raise
        finally:
            pool.release(replica)
            call.live.pop(rid, None)
        pool.mark_ok(replica)
        kv = response.kv_transfer_params
        if not kv:
            pool.mark_failed(replica)
            raise EngineUnavailable(f"prefill engine {replica.url} returned no kv_transfer_params "
                                    f"(is it started with --kv-transfer-config?)")
        identity = kv_identity(kv)
        if identity is not None:
            self.kv_identities[replica.url] = identity
        return kv, rid

    async def _start(self, pool_name: str, key: int | None, body: bytes, rid: str, tried: set[str],
                     call: EngineCall, prefer: str | None = None, replica: Replica | None = None) -> LiveStream:
        pool = self.pools[pool_name]
        replica = replica or self._pick(pool, key, tried, prefer)
        pool.acquire(replica)
        call.live[rid] = replica.url
        events = None
        try:
            events = await self.client.open_stream(replica.url, body, call.wire_id(rid), call.tenant)
            first = await events.next_batch()
            if first is None:  # [DONE] and not one event: this engine did not serve the request
                raise EngineUnavailable(f"{replica.url}: stream ended without an event")
        except BaseException as exc:
            if events is not None:
                events.close()
            if isinstance(exc, EngineUnavailable):
                self._failed(pool, replica)
            pool.release(replica)
            call.live.pop(rid, None)
            raise
        pool.mark_ok(replica)
        live = LiveStream(self, pool, replica, rid, call, events, first)
        live.seen(first)
        return live

    def _failed(self, pool: ReplicaPool, replica: Replica) -> None:
        if pool.name == "decode":
            self.prefixes.forget(replica.url)
        self.stats.engine_failures += 1
        metrics.ENGINE_FAILURES.labels(pool=pool.name).inc()
        pool.mark_failed(replica)

    @staticmethod
    def _pick(pool: ReplicaPool, key: int | None, tried: set[str], prefer: str | None = None,
              mark: bool = True) -> Replica:
        replica = (preferred_replica(pool, prefer, tried) if prefer else None) or pool.choose(key, frozenset(tried))
        if replica is None:
            raise NoReplica(f"every {pool.name} replica has been tried")
        if mark:
            tried.add(replica.url)
        return replica

    # ------------------------------------------------------------------------------------- aborts

    def abort_soon(self, call: EngineCall, request_id: str | None = None) -> None:
        """Fire-and-forget aborts for what is still live (safe from a cancelled task's cleanup)."""
        for url, ids in call.take(request_id):
            self._abort_later(url, ids)

    def _abort_later(self, url: str, ids: list[str]) -> None:
        self.stats.aborts += 1
        metrics.ABORTS.inc()
        task = asyncio.get_running_loop().create_task(self.client.abort(url, ids))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def snapshot(self) -> dict[str, Any]:
        return {"mode": self.mode, "pools": {name: p.snapshot() for name, p in self.pools.items()},
                "stats": dataclasses.asdict(self.stats)}


class LiveStream:
    """An engine stream past its first events, committed to its replica; the rest of its events are pushed
    (``push``). The replica is released once, when the stream ends or is closed; a failure from here on
    marks the replica failed and is an ``EngineStreamBroken``."""

    def __init__(self, gateway: Gateway, pool: ReplicaPool, replica: Replica, rid: str, call: EngineCall,
                 events: EngineEvents, first: list[GenerateStreamResponse]) -> None:
        self._gateway = gateway
        self._pool = pool
        self._replica = replica
        self._rid = rid
        self._call = call
        self._events = events
        self.first = first
        self._released = False

    def seen(self, batch: list[GenerateStreamResponse]) -> None:
        """Per batch: decode's end-of-turn kv_transfer_params are kept for the conversation's next turn."""
        conversation = self._call.conversation
        if conversation:
            for chunk in batch:
                if chunk.kv_transfer_params is not None:
                    self._gateway.conversations.put(conversation, chunk.kv_transfer_params, self._replica.url)

    def push(self, on_batch: Callable[[list[GenerateStreamResponse]], None],
             on_end: Callable[[Exception | None], None]) -> None:
        """The rest of the events, handed over in the engine connection's data callback (see EngineEvents.push)."""

        def batch(events: list[GenerateStreamResponse]) -> None:
            self.seen(events)
            on_batch(events)

        def end(error: Exception | None) -> None:
            # An engine refusing the request (a 4xx error event) is healthy: the client's request was wrong.
            self._release(failed=error is not None and not isinstance(error, EngineRejected))
            on_end(error)

        self._events.push(batch if self._call.conversation else on_batch, end)

    def pause(self) -> None:
        self._events.pause()

    def resume(self) -> None:
        self._events.resume()

    def close(self) -> None:
        """Stop reading: an unfinished stream's connection closes, which the engine takes as an abort."""
        self._events.close()
        self._release()

    def _release(self, failed: bool = False) -> None:
        if self._released:
            return
        self._released = True
        if failed:
            self._gateway._failed(self._pool, self._replica)
        self._pool.release(self._replica)
        self._call.live.pop(self._rid, None)


class WholeResponse:
    """A non-streamed generate response in a LiveStream's place: its choices are the first (and only) events,
    and it carries the prompt's logprobs."""

    def __init__(self, response: GenerateResponse) -> None:
        self.prompt_logprobs = response.prompt_logprobs
        self.first = [GenerateStreamResponse(request_id=response.request_id, choices=[
            GenerateStreamChoice(index=c.index, token_ids=c.token_ids or [], finish_reason=c.finish_reason or "stop",
                                 stop_reason=c.stop_reason, logprobs=c.logprobs, weight_versions=c.weight_versions)
            for c in response.choices])]

    def push(self, on_batch: Callable[[list[GenerateStreamResponse]], None],
             on_end: Callable[[Exception | None], None]) -> None:
        on_end(None)  # every event was in ``first``

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------- engine requests


@dataclass
class EngineStream:
    """One engine generate call serving choices ``first .. first+count-1`` of one rendered prompt."""

    gen: GenerateRequest
    prompt_index: int
    first: int
    count: int


def fanout_violation(gens: list[GenerateRequest], max_num_seqs: int) -> str | None:
    """P/D runs each of a prompt's n choices as its own prefill and decode call, so no engine sees n: the
    gateway applies the bound a collocated engine applies to n (its max_num_seqs), in the engine's words."""
    for gen in gens:
        n = gen.sampling_params.n or 1
        if n > max_num_seqs:
            return f"n must be between 1 and max_num_seqs ({max_num_seqs}), got {n}."
    return None


def plan_streams(gens: list[GenerateRequest], disaggregated: bool) -> list[EngineStream]:
    """One engine call per prompt; in P/D, n > 1 becomes n calls of n = 1 (a prefill lease is pulled by
    one decode sequence; each call prefills again, which the prefill engine's prefix cache absorbs).
    With a seed, call i samples with seed + i so that the choices differ as they would with n."""
    out = []
    for p, gen in enumerate(gens):
        n = gen.sampling_params.n or 1
        if not disaggregated or n == 1:
            out.append(EngineStream(gen, p, 0, n))
            continue
        for i in range(n):
            sp = gen.sampling_params
            sp = msgspec.structs.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + i)
            out.append(EngineStream(msgspec.structs.replace(gen, request_id=f"{gen.request_id}-n{i}",
                                                            sampling_params=sp), p, i, 1))
    return out


def _engine_sampling(sp: SamplingParams, **changes: Any) -> SamplingParams:
    # Stop strings are the gateway's (the engine refuses them); client kv_transfer_params are untrusted.
    return msgspec.structs.replace(sp, stop=None, extra_args=None, output_text_buffer_length=0, **changes)


def engine_request(gen: GenerateRequest) -> GenerateRequest:
    """The collocated (and decode) request: always streamed; usage and prompt ids are the gateway's own.

    ``model`` is dropped: the engine may serve the weights under another name than the render tier does.
    ``reasoning_ended`` stays: structured outputs (forced tool_choice) wait for the end of reasoning on it.
    """
    return msgspec.structs.replace(
        gen, model=None, sampling_params=_engine_sampling(gen.sampling_params), stream=True,
        stream_options=ENGINE_USAGE, return_token_ids=None, kv_transfer_params=None, reasoning_parser_kwargs=None,
    )


# The engine's usage event: its prompt_tokens is checked against the ids render produced (merged.py).
ENGINE_USAGE = StreamOptions(include_usage=True)


def whole_request(gen: GenerateRequest) -> GenerateRequest:
    """A request that wants its prompt's logprobs: one non-streamed call (engines stream no prompt logprobs)."""
    return msgspec.structs.replace(engine_request(gen), stream=False)


def prefill_request(gen: GenerateRequest, kv: dict[str, Any] | None = None) -> GenerateRequest:
    sp = _engine_sampling(gen.sampling_params, max_tokens=1, min_tokens=0, n=1, logprobs=None)
    return msgspec.structs.replace(
        gen, model=None, sampling_params=sp, stream=False, stream_options=None, return_token_ids=None,
        kv_transfer_params=dict(kv or PREFILL_KV_PARAMS), reasoning_ended=None, reasoning_parser_kwargs=None,
    )


def decode_request(gen: GenerateRequest, kv: dict[str, Any]) -> GenerateRequest:
    return msgspec.structs.replace(engine_request(gen), kv_transfer_params={**kv, "prompt_token_ids": gen.token_ids})


__all__ = ["Gateway", "GatewaySettings", "EngineCall", "LiveStream", "WholeResponse", "EngineStream", "plan_streams",
           "fanout_violation",
           "NoReplica", "EngineRejected", "EngineStreamBroken", "engine_request", "whole_request", "prefill_request",
           "decode_request"]
