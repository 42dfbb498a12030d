"""A stand-alone prefill-like peer for tests, preflight and benchmarks: a KV pool filled with a known pattern,
a `KVHandoff` serving it, and a line protocol on stdin/stdout so a parent process can drive it.

Commands (one JSON object per line on stdin), answers (one line on stdout prefixed with `PEER `, because
NIXL and UCX also write to stdout):
  {"op": "hold", "request_id": "r1", "blocks": [3, 4, 5]}   -> {"epoch": E}   (optional "lease_s", "token_hash")
  {"op": "release", "request_id": "r1", "epoch": E}         -> {"released": true|false}
  {"op": "state"}                                           -> {"leases": n, "held_blocks": n, "freed": [..]}
  {"op": "lease", "request_id": "r1"}                       -> {"expires_in": [s, ..]}  (one per held epoch)
  {"op": "advance", "s": 90}                                -> {"advanced": 90}  (moves the lease clock on;
                                                               the next poll expires what is due, as in an engine)
  {"op": "exit"}
A command may carry "seq": N; its answer carries the same, so a parent never takes a late answer to an earlier
command for the answer to this one. The first line is `PEER {"ready": true, "port": P, "engine_id": ..., ...}`.
Run: python -m token_engine.kv_tools.loopback_peer --blocks 64 --layers 2 --block-size 16 ...
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time

import torch

PEER_TOKEN_HASH = "0123456789abcdef" * 2  # the token hash a hold vouches for unless told another
ANSWER_GUARD_S = 600.0  # only stops a dead peer from hanging the parent; a busy machine never reaches it

def fill_pattern(kv_pool: torch.Tensor, seed: int) -> None:
    """Each block gets a distinct, exactly representable pattern (small integers survive bf16)."""
    flat = kv_pool.view(kv_pool.shape[0], -1)
    cols = torch.arange(flat.shape[1], dtype=torch.int64)
    for b in range(flat.shape[0]):
        flat[b] = ((cols + b * 13 + seed * 101) % 251).to(kv_pool.dtype)


def expected_block(kv_pool_shape, dtype, block_id: int, seed: int) -> torch.Tensor:
    per_block = 1
    for d in kv_pool_shape[1:]:
        per_block *= d
    cols = torch.arange(per_block, dtype=torch.int64)
    return ((cols + block_id * 13 + seed * 101) % 251).to(dtype)


def make_pool(blocks: int, layers: int, block_size: int, heads: int, head_dim: int, dtype: str, device: str = "cpu"):
    return torch.zeros(blocks, layers, 2, block_size, heads, head_dim, dtype=getattr(torch, dtype), device=device)


class LoopbackPeer:
    """Parent-side handle on a loopback peer process (tests, preflight, bench)."""

    def __init__(self, *args: str, env: dict | None = None, startup_timeout_s: float = 120.0):
        import os
        import subprocess

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "token_engine.kv_tools.loopback_peer", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.noise: list[str] = []
        self._seq = 0
        ready = self._answer(None, startup_timeout_s)
        self.port: int = ready["port"]
        self.engine_id: str = ready["engine_id"]
        self.incarnation: int = ready["incarnation"]

    def _answer(self, seq: int | None, timeout_s: float = ANSWER_GUARD_S) -> dict:
        import select

        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise TimeoutError("loopback peer did not answer")
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"loopback peer exited (rc={self.proc.poll()}); output: {self.noise[-5:]}")
            if line.startswith("PEER "):
                answer = json.loads(line[5:])
                if answer.pop("seq", None) == seq:
                    return answer
                continue  # the answer to an earlier command that its caller gave up on
            self.noise.append(line.rstrip())

    def ask(self, **cmd) -> dict:
        self._seq += 1
        self.proc.stdin.write(json.dumps({**cmd, "seq": self._seq}) + "\n")
        self.proc.stdin.flush()
        return self._answer(self._seq)

    def hold(self, request_id: str, blocks: list[int], lease_s: float | None = None,
             token_hash: str = PEER_TOKEN_HASH) -> int:
        return self.ask(op="hold", request_id=request_id, blocks=blocks, lease_s=lease_s,
                        token_hash=token_hash)["epoch"]

    def state(self) -> dict:
        return self.ask(op="state")

    def lease_expires_in(self, request_id: str) -> list[float]:
        """Seconds until each held lease of `request_id` expires on the peer's lease clock."""
        return self.ask(op="lease", request_id=request_id)["expires_in"]

    def advance(self, seconds: float) -> None:
        """Move the peer's lease clock on by `seconds`: leases due by then expire at its next poll, through
        the same `LeaseTable.expire` an engine's step calls."""
        self.ask(op="advance", s=seconds)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stdin.close()

    def close(self) -> None:
        import subprocess

        if self.proc.poll() is None:
            try:
                self.ask(op="exit")
                self.proc.wait(timeout=10)
            except (OSError, TimeoutError, RuntimeError, ValueError, subprocess.TimeoutExpired):
                pass  # a slow or stuck exit: kill() below ends it
        self.kill()


def _say(obj, seq=None) -> None:
    sys.stdout.write("PEER " + json.dumps(obj if seq is None else {**obj, "seq": seq}) + "\n")
    sys.stdout.flush()


class AdvancingClock:
    """time.monotonic plus an offset the parent can move on (`advance`): lets a test drive lease expiry
    without waiting for it. It stays monotonic, so every other deadline of the peer keeps real time."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


def main(argv: list[str] | None = None) -> None:
    from token_engine.kv_connector.handoff import KVHandoff

    ap = argparse.ArgumentParser()
    ap.add_argument("--engine-id", default="loopback-prefill")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lease", type=float, default=30.0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--poll-interval", type=float, default=0.0005)
    ap.add_argument("--secret", default=None, help="side-channel secret (default: $SPLITSERVE_KV_SECRET)")
    args = ap.parse_args(argv)

    pool = make_pool(args.blocks, args.layers, args.block_size, args.heads, args.head_dim, args.dtype, args.device)
    if args.device == "cpu":
        fill_pattern(pool, args.seed)
    else:
        cpu = make_pool(args.blocks, args.layers, args.block_size, args.heads, args.head_dim, args.dtype)
        fill_pattern(cpu, args.seed)
        pool.copy_(cpu)
    import os

    secret = args.secret or os.environ.get("SPLITSERVE_KV_SECRET")
    clock = AdvancingClock()
    handoff = KVHandoff(args.engine_id, pool, lease_duration_s=args.lease, side_channel_port=args.port,
                        secret=secret.encode() if secret else None, clock=clock)
    commands: queue.Queue = queue.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            commands.put(line)
        commands.put('{"op": "exit"}')

    threading.Thread(target=read_stdin, daemon=True).start()
    _say({"ready": True, "port": handoff.side_channel.port, "engine_id": args.engine_id,
          "incarnation": handoff.incarnation})
    freed: list[list] = []
    while True:
        polled = handoff.poll()
        freed.extend([lease.request_id, lease.epoch] for lease in polled.freed)
        try:
            cmd = json.loads(commands.get(timeout=args.poll_interval))
        except queue.Empty:
            continue
        op, seq = cmd.get("op"), cmd.get("seq")
        if op == "hold":
            lease = handoff.hold(cmd["request_id"], cmd["blocks"], cmd.get("lease_s"),
                                 cmd.get("token_hash") or PEER_TOKEN_HASH)
            _say({"epoch": lease.epoch}, seq)
        elif op == "release":
            _say({"released": handoff.release_hold(cmd["request_id"], cmd["epoch"]) is not None}, seq)
        elif op == "state":
            _say({"leases": len(handoff.leases), "held_blocks": handoff.leases.held_blocks(), "freed": freed}, seq)
            freed = []
        elif op == "lease":
            now = clock()
            _say({"expires_in": [lease.expires_at - now for lease in handoff.leases.find(cmd["request_id"])]}, seq)
        elif op == "advance":
            clock.offset += float(cmd["s"])
            _say({"advanced": cmd["s"]}, seq)
        elif op == "exit":
            handoff.close()
            _say({"bye": True}, seq)
            return
        else:
            _say({"error": f"unknown op {op!r}"}, seq)


if __name__ == "__main__":
    main()
