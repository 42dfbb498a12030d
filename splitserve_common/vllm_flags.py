"""vLLM command-line flags that both tiers take so that vLLM manifests start them unchanged: the ones with
no effect here are accepted and logged once at startup, the parallelism ones refused unless they ask for
one device, and uvicorn's log level is applied."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass


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
