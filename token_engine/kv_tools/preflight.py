"""`token-engine preflight`: check the KV transfer path between two local NIXL agents before anyone benchmarks.

It starts a loopback prefill peer (its own process, a KV pool of the given geometry) and a probe process that
plays decode with `UCX_PROTO_INFO=y`, then reports:
- the protocol UCX chose for READs (cma/memory on CPU, cuda_ipc on GPU; TCP "software emulation" is the
  slow path nixl.md §6 warns about: a late CUDA context, or missing UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y),
- bandwidth for 1 block and for a large contiguous run (one descriptor),
- descriptor cost: the same run with scattered block ids (one descriptor per block) against contiguous,
and prints a verdict: OK, WARN (works, slow path) or FAIL (no transfer).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time

PROTO_WORDS = ("cuda_ipc", "cma", "knem", "xpmem", "rc_mlx5", "rc_verbs", "dc_mlx5", "ud_mlx5", "tcp", "emulation")


def _args(argv):
    ap = argparse.ArgumentParser(prog="token-engine preflight", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--large-blocks", type=int, default=64, help="blocks in the large run (512 = 8k tokens)")
    ap.add_argument("--prefill-device", default="cpu")
    ap.add_argument("--decode-device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ap.add_argument("--probe-port", type=int, default=None, help=argparse.SUPPRESS)  # internal: probe mode
    return ap.parse_args(argv)


def _geometry_args(a) -> list[str]:
    return ["--layers", str(a.layers), "--heads", str(a.heads), "--head-dim", str(a.head_dim),
            "--block-size", str(a.block_size), "--dtype", a.dtype, "--blocks", str(2 * a.large_blocks + 1)]


def _timed_read(transport, peer: str, local: list[int], remote: list[int]) -> tuple[float, int]:
    read_id = transport.start_read(peer, local, remote, b"", timeout_s=60)
    while True:
        for r in transport.poll().reads:
            if r.read_id == read_id:
                if not r.ok:
                    raise RuntimeError(f"READ failed: {r.error}")
                return r.seconds, r.descriptors


def probe(a) -> dict:
    """Decode side, run in its own process so UCX_PROTO_INFO output can be captured."""
    from token_engine.kv_connector.nixl_transport import NixlTransport
    from token_engine.kv_connector.side_channel import fetch_publication
    from token_engine.kv_tools.loopback_peer import make_pool

    n = 2 * a.large_blocks + 1
    pool = make_pool(n, a.layers, a.block_size, a.heads, a.head_dim, a.dtype, a.decode_device)
    transport = NixlTransport(f"preflight-decode-{os.getpid()}", pool)  # pool first: CUDA ordering rule
    secret = os.environ.get("SPLITSERVE_KV_SECRET")  # the loopback peer reads the same variable
    pub, layout = fetch_publication("127.0.0.1", a.probe_port, secret=secret.encode() if secret else None)
    peer = transport.add_peer(pub, layout)
    bb = layout.geometry.block_bytes
    big = a.large_blocks
    t0 = time.perf_counter()
    _timed_read(transport, peer, [0], [0])  # wire-up
    first_read_s = time.perf_counter() - t0
    one = [_timed_read(transport, peer, [1], [2])[0] for _ in range(max(3, a.repeats * 4))]
    remote = list(range(1, big + 1))
    random.Random(0).shuffle(remote)
    # one untimed pass each first: the local pool's pages are touched (faulted in) by the first READ
    _timed_read(transport, peer, list(range(big)), list(range(1, big + 1)))
    _timed_read(transport, peer, list(range(big, 2 * big)), remote)
    contiguous = [_timed_read(transport, peer, list(range(big)), list(range(1, big + 1))) for _ in range(a.repeats)]
    scattered = [_timed_read(transport, peer, list(range(big, 2 * big)), remote) for _ in range(a.repeats)]
    transport.close()
    c_s = statistics.median(t for t, _ in contiguous)
    s_s = statistics.median(t for t, _ in scattered)
    c_d, s_d = contiguous[0][1], scattered[0][1]
    return {
        "block_bytes": bb, "large_bytes": big * bb, "first_read_ms": first_read_s * 1e3,
        "one_block_ms": statistics.median(one) * 1e3, "one_block_gbps": bb / statistics.median(one) / 1e9,
        "contiguous_ms": c_s * 1e3, "contiguous_gbps": big * bb / c_s / 1e9, "contiguous_descriptors": c_d,
        "scattered_ms": s_s * 1e3, "scattered_gbps": big * bb / s_s / 1e9, "scattered_descriptors": s_d,
        "us_per_descriptor": (s_s - c_s) / max(1, s_d - c_d) * 1e6,
    }


def protocols_from(ucx_output: str) -> list[str]:
    """Transport names in the UCX_PROTO_INFO tables titled "remote memory read by ucp_get*" (NIXL READs)."""
    found, in_read_table = [], False
    for line in ucx_output.splitlines():
        low = line.lower()
        if " by ucp_" in low:  # a table title line
            in_read_table = "remote memory read" in low
            continue
        if not in_read_table or low.count("|") < 3:
            continue
        row = low.split("]")[-1]  # drop the timestamp/host prefix; description and config columns both count
        for word in PROTO_WORDS:
            if re.search(rf"\b{word}\b", row) and word not in found:
                found.append(word)
    return found


def verdict(result: dict, protocols: list[str], device: str) -> tuple[str, str]:
    slow = "emulation" in protocols or (protocols and set(protocols) <= {"tcp"})
    if device.startswith("cuda"):
        if "cuda_ipc" in protocols and not slow:
            return "OK", "GPU memory moves over cuda_ipc"
        return "WARN", ("GPU READs are not on cuda_ipc (TCP emulation?): create the CUDA context and register "
                        "the KV pool before add_remote_agent, set UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y, avoid "
                        "expandable_segments")
    if slow:
        return "WARN", "host memory READs go over TCP, not cma: expect ~0.5 GB/s"
    return "OK", "host memory READs use cross-memory attach" if "cma" in protocols else "READs work"


def run(a) -> dict:
    from token_engine.kv_tools.loopback_peer import LoopbackPeer

    peer = LoopbackPeer(*_geometry_args(a), "--engine-id", "preflight-prefill", "--device", a.prefill_device)
    try:
        env = {**os.environ, "UCX_PROTO_INFO": "y"}
        cmd = [sys.executable, "-m", "token_engine.kv_tools.preflight",
               "--probe-port", str(peer.port), "--layers", str(a.layers), "--heads", str(a.heads),
               "--head-dim", str(a.head_dim), "--block-size", str(a.block_size), "--dtype", a.dtype,
               "--large-blocks", str(a.large_blocks), "--decode-device", a.decode_device,
               "--repeats", str(a.repeats)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    finally:
        peer.close()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    if proc.returncode != 0 or not lines:
        return {"verdict": "FAIL", "why": f"probe failed (rc={proc.returncode}): {proc.stderr[-2000:]}"}
    result = json.loads(lines[-1][6:])
    protocols = protocols_from(proc.stdout + proc.stderr)
    result["protocols"] = protocols
    result["verdict"], result["why"] = verdict(result, protocols, a.decode_device)
    return result


def report(r: dict) -> str:
    if "one_block_ms" not in r:
        return f"KV transfer preflight: {r['verdict']}: {r['why']}"
    return "\n".join([
        f"KV transfer preflight: {r['verdict']}: {r['why']}",
        f"  protocol (UCX_PROTO_INFO): {', '.join(r['protocols']) or 'not reported'}",
        f"  first READ (wire-up):      {r['first_read_ms']:.2f} ms",
        f"  1 block ({r['block_bytes'] / 1e6:.2f} MB):        {r['one_block_ms']:.3f} ms, "
        f"{r['one_block_gbps']:.2f} GB/s",
        f"  large run ({r['large_bytes'] / 1e6:.1f} MB), contiguous: {r['contiguous_ms']:.2f} ms, "
        f"{r['contiguous_gbps']:.2f} GB/s, {r['contiguous_descriptors']} descriptor(s)",
        f"  same bytes, scattered:     {r['scattered_ms']:.2f} ms, {r['scattered_gbps']:.2f} GB/s, "
        f"{r['scattered_descriptors']} descriptors",
        f"  cost per extra descriptor: {r['us_per_descriptor']:.1f} us",
    ])


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.probe_port is not None:
        sys.stdout.write("PROBE " + json.dumps(probe(a)) + "\n")
        return 0
    r = run(a)
    print(json.dumps(r) if a.json else report(r))
    return 0 if r["verdict"] != "FAIL" else 1


if __name__ == "__main__":
    sys.exit(main())
