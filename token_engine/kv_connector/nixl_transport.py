"""A thin wrapper around one NIXL agent: UCX only, no progress thread, progress driven by `poll()`.

Facts from reference/nixl.md that shape this file:
- NIXL's progress thread busy-spins a core per agent (`pthrDelay=0`), so it is off; the owner must call
  `poll()` regularly (every engine step, and about every 1 ms while a transfer or lease is live), because
  with the thread off a peer's first READ cannot even wire up unless the target calls into NIXL.
- Errors come both as exceptions with no common base class (nixlRemoteDisconnectError, nixlNotFoundError,
  ...) and as an "ERR" state. `_nixl_call` is the one place that turns all of them into `KVTransferError`.
- A stuck peer leaves a READ in PROC forever: every READ carries our own deadline.
- A restarted peer keeps its agent name; `add_remote_agent` then fails with nixlNotAllowedError until the
  old one is removed. `add_peer` removes and re-adds when the published incarnation changes.
- GPU path: the CUDA context must exist and the KV pool must be registered BEFORE `add_remote_agent`,
  otherwise UCX silently picks TCP emulation (0.3-0.5 GB/s instead of cuda_ipc). This class registers the
  pool in its constructor (the pool tensor already lives on the device, so the context exists) and only
  then accepts peers. `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y` is set before the agent (hence UCX) is created when
  the pool is on a GPU: without it GPUs lacking active NVLink also fall back to TCP emulation. Check once
  with `UCX_PROTO_INFO=y`: the READ line must say `cuda_ipc/cuda`.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field

from token_engine.kv_connector.descriptors import PoolLayout, layout_of, read_descriptors
from token_engine.kv_connector.side_channel import AgentPublication, WireGeometry


class KVTransferError(Exception):
    """A NIXL call failed, a transfer ended in ERR, or our own deadline passed."""

    def __init__(self, message: str, reason: str = "nixl_error"):
        super().__init__(message)
        self.reason = reason


_NIXL_ERRORS: tuple[type[BaseException], ...] = ()


def _import_nixl():
    """Import NIXL lazily (about 1.3 s) and collect its exception types for the one error path."""
    global _NIXL_ERRORS
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    import nixl  # noqa: F401  (selects the nixl_cu12/cu13 build)
    from nixl import _bindings
    from nixl._api import nixl_agent, nixl_agent_config

    _NIXL_ERRORS = tuple(
        getattr(_bindings, n) for n in dir(_bindings)
        if n.startswith("nixl") and n.endswith("Error") and isinstance(getattr(_bindings, n), type))
    return nixl_agent, nixl_agent_config


def _nixl_call(what: str, fn, *args, **kwargs):
    """Run one NIXL call; every nixl*Error and every "ERR" state becomes KVTransferError."""
    try:
        result = fn(*args, **kwargs)
    except _NIXL_ERRORS as e:
        reason = "disconnect" if "Disconnect" in type(e).__name__ else "nixl_error"
        raise KVTransferError(f"{what}: {type(e).__name__}: {e}", reason) from e
    if result == "ERR":
        raise KVTransferError(f"{what}: transfer state ERR", "nixl_error")
    return result


@dataclass
class ReadResult:
    """Outcome of one READ: ok, or the reason it failed. Times in seconds."""

    read_id: int
    peer: str
    ok: bool
    error: str = ""
    reason: str = ""
    bytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0


@dataclass
class _InflightRead:
    read_id: int
    peer: str
    handle: object
    deadline: float
    started: float
    bytes: int
    descriptors: int


@dataclass
class PollResult:
    reads: list[ReadResult] = field(default_factory=list)
    notifications: list[tuple[str, bytes]] = field(default_factory=list)


@dataclass
class _Peer:
    name: str
    incarnation: int
    metadata: bytes
    layout: PoolLayout


class NixlTransport:
    """One NIXL agent owning one registered KV pool; READs remote blocks into local blocks."""

    def __init__(self, agent_name: str, kv_pool, backends: tuple[str, ...] = ("UCX",), clock=time.monotonic):
        if tuple(backends) != ("UCX",):
            raise ValueError(f"only the UCX backend is supported, got {list(backends)}")
        self.layout = layout_of(kv_pool)
        if self.layout.mem_type == "VRAM":
            os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
        nixl_agent, nixl_agent_config = _import_nixl()
        self.agent_name = agent_name
        self._clock = clock
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
        self._agent = _nixl_call("create agent", nixl_agent, agent_name, config)
        self._kv_pool = kv_pool  # keep the registered memory alive as long as the agent
        self._reg = _nixl_call("register KV pool", self._agent.register_memory, kv_pool)
        self._peers: dict[str, _Peer] = {}
        self._inflight: dict[int, _InflightRead] = {}
        self._dropped: list[ReadResult] = []  # reads ended by remove_peer, reported by the next poll()
        self._ids = itertools.count(1)

    # -- metadata -------------------------------------------------------------------------------------

    def publication(self, engine_id: str, incarnation: int) -> AgentPublication:
        g = self.layout.geometry
        return AgentPublication(
            engine_id=engine_id, agent_name=self.agent_name,
            agent_metadata=_nixl_call("get metadata", self._agent.get_agent_metadata),
            incarnation=incarnation, base_addr=self.layout.base_addr, mem_type=self.layout.mem_type,
            device_id=self.layout.device_id,
            geometry=WireGeometry(g.num_blocks, g.num_layers, g.block_size, g.num_kv_heads, g.head_dim, g.dtype))

    def add_peer(self, pub: AgentPublication, layout: PoolLayout) -> str:
        """Load a peer's metadata; a known name with a new incarnation (restarted peer) is removed first."""
        old = self._peers.get(pub.agent_name)
        if old is not None:
            if old.incarnation == pub.incarnation and old.metadata == pub.agent_metadata:
                return old.name
            self.remove_peer(old.name)
        if not self.layout.geometry.compatible_with(layout.geometry):
            raise KVTransferError(f"peer {pub.agent_name} KV geometry {layout.geometry} does not match "
                                  f"{self.layout.geometry}", "bad_peer")
        name = _nixl_call("add remote agent", self._agent.add_remote_agent, pub.agent_metadata)
        if isinstance(name, bytes):
            name = name.decode()
        if name != pub.agent_name:
            self._forget_agent(name)
            raise KVTransferError(f"metadata names agent {name!r}, publication says {pub.agent_name!r}", "bad_peer")
        self._peers[name] = _Peer(name, pub.incarnation, pub.agent_metadata, layout)
        return name

    def peer_incarnation(self, name: str) -> int | None:
        peer = self._peers.get(name)
        return peer.incarnation if peer else None

    def remove_peer(self, name: str) -> None:
        """Fail the peer's in-flight reads and drop its metadata (also disconnects UCX endpoints)."""
        now = self._clock()
        for r in [r for r in self._inflight.values() if r.peer == name]:
            self._dropped.append(self._finish(r, now, f"peer {name} removed", "disconnect"))
        self._peers.pop(name, None)
        self._forget_agent(name)

    def _forget_agent(self, name: str) -> None:
        try:
            _nixl_call("remove remote agent", self._agent.remove_remote_agent, name)
        except KVTransferError:
            pass  # already gone; nothing else to undo

    # -- transfers ------------------------------------------------------------------------------------

    def start_read(self, peer: str, local_ids: list[int], remote_ids: list[int], notif: bytes,
                   timeout_s: float) -> int:
        """Post a READ of `remote_ids` on `peer` into `local_ids`; `notif` reaches the peer once it is done.
        Returns a read id whose outcome a later `poll()` reports."""
        return self._start("READ", peer, local_ids, remote_ids, notif, timeout_s)

    def start_write(self, peer: str, local_ids: list[int], remote_ids: list[int], notif: bytes,
                    timeout_s: float) -> int:
        """Post a WRITE of our `local_ids` into `remote_ids` on `peer` (push mode); `notif` (may be empty)
        reaches the peer after the bytes. Its outcome comes from `poll()` like a READ's, under the same id space."""
        return self._start("WRITE", peer, local_ids, remote_ids, notif, timeout_s)

    def _start(self, op: str, peer: str, local_ids: list[int], remote_ids: list[int], notif: bytes,
               timeout_s: float) -> int:
        p = self._peers.get(peer)
        if p is None:
            raise KVTransferError(f"unknown peer {peer!r}", "bad_peer")
        try:
            local_descs, remote_descs = read_descriptors(self.layout, p.layout, local_ids, remote_ids)
        except ValueError as e:
            raise KVTransferError(str(e), "bad_request") from e
        started = self._clock()
        local = _nixl_call("local descs", self._agent.get_xfer_descs, local_descs, self.layout.mem_type)
        remote = _nixl_call("remote descs", self._agent.get_xfer_descs, remote_descs, p.layout.mem_type)
        handle = _nixl_call(f"initialize {op}", self._agent.initialize_xfer, op, local, remote, peer, notif)
        read = _InflightRead(next(self._ids), peer, handle, started + timeout_s, started,
                             int(local_descs[:, 1].sum()), len(local_descs))
        try:
            _nixl_call(f"post {op}", self._agent.transfer, handle)
        except KVTransferError:
            self._release(read)
            raise
        self._inflight[read.read_id] = read
        return read.read_id

    def send_notif(self, peer: str, msg: bytes) -> None:
        _nixl_call("send notification", self._agent.send_notif, peer, msg)

    def poll(self) -> PollResult:
        """Drive NIXL progress: finish, fail or time out in-flight READs and collect notifications."""
        out = PollResult(reads=self._dropped)
        self._dropped = []
        now = self._clock()
        for read in list(self._inflight.values()):
            try:
                state = _nixl_call("check READ", self._agent.check_xfer_state, read.handle)
            except KVTransferError as e:
                out.reads.append(self._finish(read, now, str(e), e.reason))
                continue
            if state == "DONE":
                out.reads.append(self._finish(read, now))
            elif now > read.deadline:
                out.reads.append(self._finish(read, now, "READ deadline passed (peer stuck?)", "timeout"))
        notifs = _nixl_call("get notifications", self._agent.get_new_notifs)
        for agent, msgs in notifs.items():
            name = agent.decode() if isinstance(agent, bytes) else agent
            out.notifications.extend((name, m) for m in msgs)
        return out

    def inflight(self) -> int:
        return len(self._inflight)

    def _finish(self, read: _InflightRead, now: float, error: str = "", reason: str = "") -> ReadResult:
        self._inflight.pop(read.read_id, None)
        self._release(read)
        return ReadResult(read.read_id, read.peer, not error, error, reason, read.bytes, read.descriptors,
                          now - read.started)

    def _release(self, read: _InflightRead) -> None:
        try:
            _nixl_call("release READ", self._agent.release_xfer_handle, read.handle)
        except KVTransferError:
            pass  # a READ stuck in PROC may refuse release; NIXL keeps it on its own leak list

    def close(self) -> None:
        for read in list(self._inflight.values()):
            self._release(read)
        self._inflight.clear()
        for name in list(self._peers):
            self.remove_peer(name)
        try:
            _nixl_call("deregister KV pool", self._agent.deregister_memory, self._reg)
        except KVTransferError:
            pass
