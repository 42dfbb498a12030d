"""vLLM command-line flags that both tiers take so that vLLM manifests start them unchanged: the ones with
no effect here are accepted and logged once at startup, the parallelism ones refused unless they ask for
one device, and uvicorn's log level is applied."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NoOpFlag:
    flag: str  # e.g. "--trust-remote-code"
    why: str  # why it changes nothing here, for the startup log
    takes_value: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


TRUST_REMOTE_CODE = NoOpFlag("--trust-remote-code", "no model code is ever loaded from a model repository")
UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]
PARALLEL_FLAGS = (("-tp", "--tensor-parallel-size"), ("-pp", "--pipeline-parallel-size"),
                  ("-dp", "--data-parallel-size"))


def add_noop_flags(parser: argparse.ArgumentParser, flags: tuple[NoOpFlag, ...]) -> None:
    group = parser.add_argument_group("accepted for vLLM compatibility (no effect)")
    for f in flags:
        if f.takes_value:
            group.add_argument(f.flag, default=None, metavar="VALUE", help=f"no effect: {f.why}")
        else:
            group.add_argument(f.flag, action="store_true", default=None, help=f"no effect: {f.why}")


def log_noop_flags(args: argparse.Namespace, flags: tuple[NoOpFlag, ...], log: logging.Logger) -> None:
    for f in flags:
        value = getattr(args, f.dest, None)
        if value is not None:
            shown = f.flag if value is True else f"{f.flag} {value}"
            log.info("%s: accepted for vLLM compatibility, no effect (%s)", shown, f.why)


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    for short, long in PARALLEL_FLAGS:
        parser.add_argument(short, long, type=int, default=1, metavar="N",
                            help="accepted for vLLM compatibility: 1 only (one device per engine; scale with replicas)")


def parallelism_error(args: argparse.Namespace, what: str) -> str | None:
    """One line refusing a parallel size other than 1, or None."""
    for short, long in PARALLEL_FLAGS:
        size = getattr(args, long.lstrip("-").replace("-", "_"))
        if size != 1:
            return (f"{long} {size} ({short}) is not supported: {what} runs on one device; run several "
                    f"replicas behind the gateway instead, each with {short} 1")
    return None


def add_uvicorn_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default=None,
                        help="level of uvicorn's own loggers (default: --log-level)")


def uvicorn_log_level(args: argparse.Namespace) -> str:
    return str(args.uvicorn_log_level or args.log_level)


def add_tls_and_hub_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's TLS, root path and model download flags, mapped onto uvicorn and the Hugging Face cache."""
    group = parser.add_argument_group("TLS and model download (vLLM's flags)")
    group.add_argument("--ssl-keyfile", default=None, help="TLS private key file (with --ssl-certfile: HTTPS)")
    group.add_argument("--ssl-certfile", default=None, help="TLS certificate chain file")
    group.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify client certificates with")
    group.add_argument("--ssl-cert-reqs", type=int, default=0,
                       help="client certificates: 0 none, 1 optional, 2 required (Python's ssl.CERT_*)")
    group.add_argument("--ssl-ciphers", default=None, help="TLS cipher list (OpenSSL syntax)")
    group.add_argument("--root-path", default=None, help="path prefix a proxy strips before the request reaches us")
    group.add_argument("--download-dir", default=None,
                       help="Hugging Face cache for a model id (as $HF_HUB_CACHE); a local directory ignores it")
    group.add_argument("--hf-token", default=None, help="token for a gated model id's download (as $HF_TOKEN)")


def uvicorn_tls_settings(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config keywords for the TLS and root-path flags (ValueError on a half-given key pair)."""
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    settings: dict[str, Any] = {}
    if args.ssl_certfile:
        settings.update(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)
        if args.ssl_ciphers:
            settings["ssl_ciphers"] = args.ssl_ciphers
    if args.root_path:
        settings["root_path"] = args.root_path
    return settings


def apply_hub_flags(args: argparse.Namespace) -> None:
    """--download-dir and --hf-token as the environment the model resolution reads."""
    if args.download_dir:
        os.environ["HF_HUB_CACHE"] = args.download_dir
    if args.hf_token:
        os.environ["HF_TOKEN"] = args.hf_token
