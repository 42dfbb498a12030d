"""The trainer's HTTP routes on token-engine, with vLLM's paths, bodies and answers (its dev-mode RL router).

Switched on as vLLM switches them on (``VLLM_SERVER_DEV_MODE=1``) or with ``--enable-rl-control``; they sit
behind the API key like every other route. Control work runs on the engine thread between steps
(``AsyncEngine.call``); errors use the engine's JSON error shape with a 4xx that names the problem.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from token_engine.http.protocol import REQUEST_ID_PREFIX, error_response
from token_engine.rl.control import WeightControl
from token_engine.rl.weights import WeightUpdateError

MAX_CONTROL_BODY_BYTES = 64 << 20  # an IPC update names every tensor of a large model
PAUSE_MODES = ("abort", "wait", "keep")
PAUSED_MESSAGE = "generation is paused for a weight update (POST /resume ends the pause)"
ASLEEP_MESSAGE = "the engine is asleep (POST /wake_up wakes it)"
DRAIN_POLL_S = 0.01


def rl_control_enabled(flag: bool | None) -> bool:
    return flag if flag is not None else os.environ.get("VLLM_SERVER_DEV_MODE", "0") == "1"


async def _body(request: Request) -> dict[str, Any]:
    """The JSON object sent, or {} for an empty body (vLLM's start_weight_update takes none)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_CONTROL_BODY_BYTES:
            raise WeightUpdateError(f"request body larger than {MAX_CONTROL_BODY_BYTES} bytes", status=413)
    if not body.strip():
        return {}
    try:
        value = msgspec.json.decode(bytes(body))
    except (msgspec.DecodeError, RecursionError) as exc:
        raise WeightUpdateError(f"Invalid JSON body: {exc}") from None
    if not isinstance(value, dict):
        raise WeightUpdateError("Request body must be a JSON object")
    return value


class ControlState:
    """Per app: the engine-thread weight control and the pause flags the routes set."""

    def __init__(self, server_state):
        self.server = server_state
        self.engine = server_state.engine  # AsyncEngine
        self.weights = WeightControl(self.engine.engine)
        self.paused = False
        self.lock = asyncio.Lock()  # one control operation at a time

    async def run(self, fn):
        return await asyncio.wrap_future(self.engine.call(fn))

    def _refusal(self) -> str | None:
        if self.weights.asleep:
            return ASLEEP_MESSAGE
        return PAUSED_MESSAGE if self.paused and not self.engine.frozen else None

    async def pause(self, mode: str) -> None:
        self.paused = True
        if mode == "keep":
            self.engine.set_frozen(True)
            self.engine.refusal = self._refusal()
            return
        self.engine.set_frozen(False)
        self.engine.refusal = self._refusal() or PAUSED_MESSAGE
        if mode == "abort":
            await self.abort_all()
        while self.engine.engine.requests:  # wait: in-flight requests run to their end
            await asyncio.sleep(DRAIN_POLL_S)

    def resume(self) -> None:
        self.paused = False
        self.engine.refusal = self._refusal()
        self.engine.set_frozen(self.weights.asleep)

    async def abort_all(self) -> int:
        def abort(llm) -> int:
            ids = list(llm.requests)
            for request_id in ids:
                llm.abort_request(request_id)
            return len(ids)

        return await self.run(abort)


def control(request: Request) -> ControlState:
    app_state = request.app.state
    existing = getattr(app_state, "rl_control", None)
    if existing is None:
        existing = app_state.rl_control = ControlState(app_state.server)
    return existing


def _handler(fn):
    async def handler(request: Request) -> Response:
        ctl = control(request)
        if not ctl.engine.is_alive():  # control work runs on the engine thread: nobody would answer
            return error_response("the engine is not running", 503)
        try:
            return await fn(request, ctl)
        except WeightUpdateError as exc:
            return error_response(exc.message, exc.status, exc.param)

    return handler


# ---- pause and abort ---------------------------------------------------------------------------------
async def pause(request: Request, ctl: ControlState) -> Response:
    mode = request.query_params.get("mode", "abort")
    if mode not in PAUSE_MODES:
        return error_response(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", param="mode")
    await ctl.pause(mode)
    return JSONResponse({"status": "paused"})


async def resume(request: Request, ctl: ControlState) -> Response:
    ctl.resume()
    return JSONResponse({"status": "resumed"})


async def is_paused(request: Request, ctl: ControlState) -> Response:
    return JSONResponse({"is_paused": ctl.paused})


async def abort_requests(request: Request, ctl: ControlState) -> Response:
    """vLLM's dev route: ``request_ids`` empty or missing aborts everything; answers how many it aborted."""
    body = await _body(request)
    ids = body.get("request_ids")
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, str) for i in ids)):
        return error_response("request_ids must be a list of strings", param="request_ids")
    if not ids:
        return JSONResponse({"status": "aborted", "aborted": await ctl.abort_all()})
    state = ctl.server
    for rid in ids:
        # The id the response carried or the caller's own: every request running under it (a GRPO group's n
        # samples and duplicates of one id alike) ends.
        names = (rid,) if rid.startswith(REQUEST_ID_PREFIX) else (rid, REQUEST_ID_PREFIX + rid)
        for name in names:
            for engine_id in state.engine_ids(name):
                state.engine.abort_request(engine_id)
        state.engine.abort_request(rid)
    return JSONResponse({"status": "aborted", "aborted": len(ids)})


# ---- weight transfer ---------------------------------------------------------------------------------
async def init_weight_transfer_engine(request: Request, ctl: ControlState) -> Response:
    body = await _body(request)
    init_info = body.get("init_info")
    if not isinstance(init_info, dict):
        return error_response("init_info (an object) is required", param="init_info")
    backend = body.get("backend")
    if backend is not None and not isinstance(backend, str):
        return error_response("backend must be a string", param="backend")
    async with ctl.lock:
        await ctl.run(lambda llm: ctl.weights.init_transfer(init_info, backend))
    return JSONResponse({"message": "Weight transfer initialized"})


async def shutdown_weight_transfer_engine(request: Request, ctl: ControlState) -> Response:
    async with ctl.lock:
        await ctl.run(lambda llm: ctl.weights.shutdown_transfer())
    return JSONResponse({"message": "Weight transfer shut down"})


async def start_weight_update(request: Request, ctl: ControlState) -> Response:
    await _body(request)  # TRL and vime send {"is_checkpoint_format": true}; vLLM 0.32-0.34 ignore it too
    async with ctl.lock:
        await ctl.run(lambda llm: ctl.weights.start())
    return JSONResponse({"message": "Weight update started"})


async def update_weights(request: Request, ctl: ControlState) -> Response:
    body = await _body(request)
    update_info = body.get("update_info")
    if not isinstance(update_info, dict):
        return error_response("update_info (an object) is required", param="update_info")
    async with ctl.lock:
        await ctl.run(lambda llm: ctl.weights.update(update_info))
    return JSONResponse({"message": "Weights updated"})


async def finish_weight_update(request: Request, ctl: ControlState) -> Response:
    body = await _body(request)
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        return error_response("weight_version must be a string", param="weight_version")
    async with ctl.lock:
        await ctl.run(lambda llm: ctl.weights.finish(version))
    return JSONResponse({"message": "Weight update finished"})


async def update_weight_version(request: Request, ctl: ControlState) -> Response:
    body = await _body(request)
    version = body.get("new_version")
    if not isinstance(version, str):
        return error_response("new_version (a string) is required", param="new_version")
    await ctl.run(lambda llm: ctl.weights.set_version(version))
    return JSONResponse({"success": True, "new_version": version})


async def weight_info(request: Request, ctl: ControlState) -> Response:
    return JSONResponse({"weight_version": ctl.engine.engine.weight_version})


async def weight_checker(request: Request, ctl: ControlState) -> Response:
    body = await _body(request)
    action, baseline = body.get("action"), body.get("baseline")
    if action not in ("checksum", "reset", "compare"):
        return error_response("action must be one of checksum, reset, compare", param="action")
    if action == "reset":
        async with ctl.lock:
            await ctl.run(lambda llm: ctl.weights.reset())
        return JSONResponse({"status": "reset"})
    if action == "compare" and not (isinstance(baseline, dict)
                                    and all(isinstance(v, str) for v in baseline.values())):
        return error_response("action='compare' requires a 'baseline' object of name -> checksum", param="baseline")
    sums = await ctl.run(lambda llm: ctl.weights.checksums())
    if action == "checksum":
        return JSONResponse({"checksums": sums})
    assert isinstance(baseline, dict)
    mismatches = sorted(k for k in sums.keys() | baseline.keys() if sums.get(k) != baseline.get(k))
    return JSONResponse({"match": not mismatches, "mismatches": mismatches})


async def get_world_size(request: Request, ctl: ControlState) -> Response:
    return JSONResponse({"world_size": 1})  # one engine process, one rank (no tensor or data parallelism)


async def collective_rpc(request: Request, ctl: ControlState) -> Response:
    """Only ``reload_weights`` (vLLM's route for SGLang's update_weights_from_disk): every weight from a
    checkpoint directory on this machine, checked whole before the first write."""
    body = await _body(request)
    method, kwargs = body.get("method"), body.get("kwargs") or {}
    if method != "reload_weights":
        return error_response(f"method {method!r} is not offered (reload_weights is)", param="method")
    if not isinstance(kwargs, dict) or not isinstance(kwargs.get("weights_path"), str):
        return error_response("kwargs.weights_path (a checkpoint directory) is required", param="weights_path")
    version = kwargs.get("weight_version")
    if version is not None and not isinstance(version, str):
        return error_response("kwargs.weight_version must be a string", param="weight_version")
    async with ctl.lock:
        await ctl.run(lambda llm: ctl.weights.reload(kwargs["weights_path"], version))
    return JSONResponse({"results": [None]})


# ---- caches and sleep --------------------------------------------------------------------------------
async def reset_prefix_cache_route(request: Request, ctl: ControlState) -> Response:
    await ctl.run(lambda llm: llm.reset_prefix_cache())
    return JSONResponse({"success": True})


async def sleep(request: Request, ctl: ControlState) -> Response:
    level_text, mode = request.query_params.get("level", "1"), request.query_params.get("mode", "abort")
    if level_text not in ("0", "1", "2"):
        return error_response(f"level must be 0, 1 or 2, got {level_text!r}", param="level")
    if mode not in PAUSE_MODES:
        return error_response(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", param="mode")
    level = int(level_text)
    async with ctl.lock:
        await ctl.pause(mode)
        await ctl.run(lambda llm: ctl.weights.sleep(level))
        ctl.engine.set_frozen(True)
        ctl.engine.refusal = ASLEEP_MESSAGE
        ctl.paused = mode == "keep"  # abort/wait end with nothing left to resume; keep resumes after wake_up
    return JSONResponse({"status": "sleeping", "level": level})


async def wake_up(request: Request, ctl: ControlState) -> Response:
    tags = request.query_params.getlist("tags") or None
    async with ctl.lock:
        await ctl.run(lambda llm: ctl.weights.wake_up())
        ctl.paused = False
        ctl.resume()
    return JSONResponse({"status": "awake", "tags": tags})


async def is_sleeping(request: Request, ctl: ControlState) -> Response:
    return JSONResponse({"is_sleeping": ctl.weights.asleep})


def rl_routes(guard) -> list[Route]:
    """The routes, each wrapped by the server's ``guard`` (a bug still answers with the error shape)."""
    table = [
        ("/pause", pause, "POST"), ("/resume", resume, "POST"), ("/is_paused", is_paused, "GET"),
        ("/abort_requests", abort_requests, "POST"),
        ("/init_weight_transfer_engine", init_weight_transfer_engine, "POST"),
        ("/shutdown_weight_transfer_engine", shutdown_weight_transfer_engine, "POST"),
        ("/start_weight_update", start_weight_update, "POST"), ("/update_weights", update_weights, "POST"),
        ("/finish_weight_update", finish_weight_update, "POST"),
        ("/update_weight_version", update_weight_version, "POST"), ("/weight_info", weight_info, "GET"),
        ("/weight_checker", weight_checker, "POST"), ("/get_world_size", get_world_size, "GET"),
        ("/collective_rpc", collective_rpc, "POST"),
        ("/reset_prefix_cache", reset_prefix_cache_route, "POST"),
        ("/sleep", sleep, "POST"), ("/wake_up", wake_up, "POST"), ("/is_sleeping", is_sleeping, "GET"),
    ]
    return [Route(path, guard(_handler(fn)), methods=[method]) for path, fn, method in table]
