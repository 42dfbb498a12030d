"""Every flag of vLLM 0.34's ``vllm serve`` / ``vllm launch render`` on both of our servers: mapped, accepted with
a note in the log, or refused at startup with one line that names the alternative; TLS flags serve HTTPS."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from render_service.cli import build_parser as render_parser
from splitserve_common import vllm_serve_flags
from splitserve_common.vllm_serve_flags import SWITCHES, VALUED, check_vllm_flags, disposition
from tests.gateway_harness import Process, free_port
from tests.shared_paths import QWEN3_FIXTURE_DIR
from token_engine.cli import build_parser as engine_parser

TIERS = {"engine": engine_parser, "render": render_parser}


def serve_parser(tier: str) -> argparse.ArgumentParser:
    parser = TIERS[tier]()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def sample_value(flag: str) -> str:
    return "7" if flag.endswith(("-size", "-port", "-len", "-count")) else "value"


@pytest.mark.parametrize("tier", TIERS)
def test_every_vllm_flag_parses_and_is_mapped_noted_or_refused(tier, caplog):
    caplog.set_level(logging.INFO, logger="flag-walk")
    parser = serve_parser(tier)
    ours = parser.get_default("vllm_flags_ours")
    seen = {"ours": 0, "note": 0, "refused": 0}
    for flag in vllm_serve_flags.vllm_flags():
        d = disposition(flag, tier, ours, None if flag in SWITCHES else sample_value(flag))
        seen[d.kind] += 1
        if d.kind == "ours":  # the server's own flag, with its own types and tests
            continue
        assert d.why, flag
        argv = ["model-dir", flag] + ([sample_value(flag)] if flag in VALUED else [])
        args = parser.parse_args(argv)  # argparse exits on a flag it does not know: that would fail here
        refusal = check_vllm_flags(args, tier, logging.getLogger("flag-walk"))
        if d.kind == "refused":
            assert refusal is not None and refusal.startswith(flag) and d.why in refusal, (flag, refusal)
        else:
            assert refusal is None, (flag, refusal)
    assert all(seen.values()), seen  # each tier maps some, notes some, refuses some
    assert "accepted for vLLM compatibility, no effect" in caplog.text


@pytest.mark.parametrize("tier,flag,value", [
    ("engine", "--quantization", "fp8"), ("engine", "--enable-lora", None), ("engine", "--speculative-config", "{}"),
    ("engine", "--api-server-count", "2"), ("render", "--allowed-origins", "*"), ("render", "--tokenizer-mode", "mistral"),
    ("render", "--skip-tokenizer-init", None), ("render", "--uds", "/tmp/s"),
])
def test_what_cannot_be_honoured_is_refused_with_a_reason(tier, flag, value):
    parser = serve_parser(tier)
    args = parser.parse_args(["model-dir", flag] + ([value] if value else []))
    refusal = check_vllm_flags(args, tier, logging.getLogger("flag-walk"))
    assert refusal is not None and refusal.startswith(flag) and "is not supported: " in refusal


@pytest.mark.parametrize("tier,flag,value", [("engine", "--api-server-count", "1"),
                                             ("render", "--tokenizer-mode", "auto"),
                                             ("render", "--quantization", "fp8")])
def test_neutral_values_and_engine_settings_on_render_are_notes(tier, flag, value):
    args = serve_parser(tier).parse_args(["model-dir", flag, value])
    assert check_vllm_flags(args, tier, logging.getLogger("flag-walk")) is None


def test_vllm_aliases_map_onto_ours():
    args = serve_parser("render").parse_args(["m", "--api-server-count", "3", "--shutdown-timeout", "5",
                                               "--block-size", "32"])
    assert (args.workers, args.shutdown_grace_seconds, args.engine_block_size) == (3, 5.0, 32)


DUMP_FLAGS = r"""
import json
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.common.cli_args import make_arg_parser
p = make_arg_parser(FlexibleArgumentParser())
print(json.dumps({o: a.nargs != 0 for a in p._actions for o in a.option_strings
                  if o.startswith("--") and a.dest != "help" and o != "--model"}))
"""


def vllm034_venv() -> Path | None:
    candidates = [Path(os.environ["SPLITSERVE_VLLM034"])] if os.environ.get("SPLITSERVE_VLLM034") else []
    candidates.append(Path(__file__).resolve().parents[1] / "bench/.peers/vllm034")
    return next((v for v in candidates if (v / "bin/python").exists()), None)


@pytest.mark.slow
def test_the_list_is_vllm_034s_own():
    venv = vllm034_venv()
    if venv is None:
        pytest.skip("vLLM 0.34 is not installed as a peer ($SPLITSERVE_VLLM034)")
    out = subprocess.run([str(venv / "bin/python"), "-c", DUMP_FLAGS], capture_output=True, text=True, timeout=600,
                         env={"PATH": os.environ.get("PATH", ""), "VLLM_TARGET_DEVICE": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    theirs = json.loads(out.stdout.splitlines()[-1])
    assert set(theirs) == set(VALUED) | set(SWITCHES)
    assert {f for f, takes in theirs.items() if takes} == set(VALUED)


@pytest.mark.slow
def test_tls_flags_serve_https(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=120)
    port = free_port()
    argv = [sys.executable, "-m", "render_service.cli", "serve", str(QWEN3_FIXTURE_DIR), "--host", "127.0.0.1",
            "--port", str(port), "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--root-path", "/api",
            "--async-scheduling", "--log-level", "info"]
    server = Process(argv, port, wait=False)
    try:
        url = f"https://127.0.0.1:{port}"
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=30) as client:
            for _ in range(900):  # a hang guard only: the server answers once its bundle is loaded
                assert server.proc.poll() is None, server.log_tail()
                try:
                    if client.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            r = client.post(url + "/tokenize", json={"model": str(QWEN3_FIXTURE_DIR), "prompt": "Hello world"})
            assert r.status_code == 200 and r.json()["tokens"] == [9707, 1879]
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)  # plain HTTP is not served
        log = server.log_tail(1 << 20)
    finally:
        server.stop()
    assert "--async-scheduling: accepted for vLLM compatibility, no effect" in log
