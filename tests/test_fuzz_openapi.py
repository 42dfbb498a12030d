"""schemathesis against each server's OpenAPI document (render service, gateway, engine), on real loopback
servers: no response >= 500, every status, content type and JSON body as the document declares.

The documents come from render_service.http.openapi and token_engine.http.openapi (generated from the msgspec wire structs), the same
ones the servers publish at /openapi.json. A bounded profile: a few examples per operation.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from render_service.gateway.flow import Gateway
from render_service.http.openapi import render_openapi
from render_service.http.server import create_app
from render_service.render.render_config import load_render_config
from splitserve_common.lifecycle import Lifecycle, wrap_app
from tests.engine_harness import engine_config
from tests.gateway_harness import write_scripted_qwen3
from token_engine.core.engine import AsyncEngine, LLMEngine
from token_engine.http.openapi import engine_openapi
from token_engine.http.server import build_app

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
PROFILE = settings(max_examples=4, deadline=None, derandomize=True, database=None,
                   suppress_health_check=list(HealthCheck))

render_schema = schemathesis.openapi.from_dict(render_openapi("test", gateway=False))
gateway_schema = schemathesis.openapi.from_dict(render_openapi("test", gateway=True)).include(
    path_regex=r"^/v1/(chat/)?completions$")
engine_schema = schemathesis.openapi.from_dict(engine_openapi("test"))


class Served:
    """An ASGI app (wrapped by the ops middleware, as the CLI serves it) on a loopback port, in a thread."""

    def __init__(self, app, openapi: dict) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        wrapped = wrap_app(app, Lifecycle(), access_log=False, openapi=openapi)
        self.server = uvicorn.Server(uvicorn.Config(wrapped, log_level="error", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        for _ in range(800):  # bounded wait for the listener
            if self.server.started:
                break
            time.sleep(0.025)
        assert self.server.started

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = write_scripted_qwen3(tmp_path_factory.mktemp("fuzz") / "tiny")
    engine = AsyncEngine(LLMEngine(engine_config(model, max_model_len=256, num_gpu_blocks_override=256)))
    engine.start()
    started = []
    try:
        started.append(eng := Served(build_app(engine, "tiny", str(model)), engine_openapi("test")))
        config = load_render_config(str(model), served_model_names=["tiny"], reasoning_parser="qwen3",
                                    tool_call_parser="hermes", enable_auto_tool_choice=True)
        started.append(render := Served(create_app(config), render_openapi("test", gateway=False)))
        gateway = Gateway(engines=[eng.url])
        started.append(gw := Served(create_app(config, gateway=gateway), render_openapi("test", gateway=True)))
        yield {"engine": eng.url, "render": render.url, "gateway": gw.url}
    finally:
        for s in reversed(started):
            s.close()
        engine.shutdown()


@render_schema.parametrize()
@PROFILE
def test_render_service_conforms_to_its_openapi_document(case, servers):
    case.call_and_validate(base_url=servers["render"], checks=CHECKS, timeout=60)


@gateway_schema.parametrize()
@PROFILE
def test_gateway_conforms_to_its_openapi_document(case, servers):
    case.call_and_validate(base_url=servers["gateway"], checks=CHECKS, timeout=60)


@engine_schema.parametrize()
@PROFILE
def test_engine_conforms_to_its_openapi_document(case, servers):
    case.call_and_validate(base_url=servers["engine"], checks=CHECKS, timeout=60)
