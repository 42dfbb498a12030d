"""Side channel that publishes a prefill engine's NIXL agent metadata, pool address and geometry.

Length-prefixed msgspec JSON over TCP (like vLLM's ZMQ side channel, without pickle). A connection may carry
any number of requests, answered in order; decode keeps one open per peer (`PeerLink`) so that a handoff
costs no TCP connect and no thread start on either side:
- `{"op": "publication"}` -> `AgentPublication`.
- `{"op": "lease_status", "request_id", "epoch", "reader", "pin_s"}` -> `LeaseStatus`: whether the lease is
  still held (or was ended by this very reader's READ notification). With `pin_s` > 0 the lease is also
  pinned to that reader for up to `pin_s` seconds (answered as `pinned_s`): it cannot expire, and no other
  reader can end it, until the reader's READ notification arrives. Decode sends this together with its
  READ, so the confirmation's round trip overlaps the copy instead of following it: "held" at the pin and
  pinned from then on means the blocks were not recycled while the READ ran. Answered from this server's
  thread, so it does not wait for prefill's next engine step.
Everything received is validated: the peer is untrusted, and a wrong base address or geometry would make
NIXL read the wrong bytes without complaint.
"""

from __future__ import annotations

import select
import socket
import struct
import threading

import msgspec

from token_engine.kv_connector.descriptors import DTYPE_SIZES, KVGeometry, PoolLayout

MAX_FRAME_BYTES = 1 << 20
MAX_METADATA_BYTES = 256 << 10
MAX_BLOCKS = 1 << 24
SOCKET_TIMEOUT_S = 5.0
IDLE_TIMEOUT_S = 600.0  # a kept-open connection with no request for this long is closed by the server
MAX_CONNECTIONS = 256


class SideChannelError(Exception):
    """The peer's side channel is unreachable or sent something we refuse to use."""


class WireGeometry(msgspec.Struct, forbid_unknown_fields=True):
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str


class AgentPublication(msgspec.Struct, forbid_unknown_fields=True):
    engine_id: str
    agent_name: str
    agent_metadata: bytes
    incarnation: int  # changes on every engine start: a restarted peer must be removed and re-added
    base_addr: int
    mem_type: str
    device_id: int
    geometry: WireGeometry
    tp_size: int = 1
    fingerprint: str = ""  # model weights + KV config (fingerprint.py): engines that differ refuse a handoff


class SideChannelRequest(msgspec.Struct, forbid_unknown_fields=True):
    op: str
    request_id: str = ""
    epoch: int = 0
    reader: str = ""
    pin_s: float = 0.0


class LeaseStatus(msgspec.Struct, forbid_unknown_fields=True):
    status: str  # "held" | "read" (ended by this reader's READ) | "gone" (expired, unknown, other reader)
    request_id: str = ""
    epoch: int = 0
    pinned_s: float = 0.0  # how long the lease is pinned to the asking reader (pin requests only)


_encoder = msgspec.json.Encoder()
_pub_decoder = msgspec.json.Decoder(AgentPublication)
_req_decoder = msgspec.json.Decoder(SideChannelRequest)
_status_decoder = msgspec.json.Decoder(LeaseStatus)


def validate_publication(pub: AgentPublication) -> PoolLayout:
    """Check every field of a received publication and return the remote pool layout it describes."""
    g = pub.geometry
    if len(pub.fingerprint) > 256:
        raise SideChannelError("fingerprint too long")
    if not pub.engine_id or len(pub.engine_id) > 256 or not pub.agent_name or len(pub.agent_name) > 256:
        raise SideChannelError("bad engine_id or agent_name")
    if not 0 < len(pub.agent_metadata) <= MAX_METADATA_BYTES:
        raise SideChannelError("agent metadata empty or too large")
    if pub.mem_type not in ("DRAM", "VRAM") or not 0 <= pub.device_id < 1024:
        raise SideChannelError(f"bad memory type {pub.mem_type!r} / device {pub.device_id}")
    if pub.tp_size != 1:
        raise SideChannelError(f"tp_size {pub.tp_size} not supported (only 1)")
    if g.dtype not in DTYPE_SIZES:
        raise SideChannelError(f"unknown KV dtype {g.dtype!r}")
    for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
        if not 0 < getattr(g, name) <= 1 << 16:
            raise SideChannelError(f"geometry {name}={getattr(g, name)} out of range")
    if not 0 < g.num_blocks <= MAX_BLOCKS:
        raise SideChannelError(f"geometry num_blocks={g.num_blocks} out of range")
    geometry = KVGeometry(g.num_blocks, g.num_layers, g.block_size, g.num_kv_heads, g.head_dim, g.dtype)
    if not 0 < pub.base_addr < 1 << 64 or pub.base_addr + g.num_blocks * geometry.block_bytes >= 1 << 64:
        raise SideChannelError("base address out of range")
    return PoolLayout(pub.base_addr, geometry, pub.mem_type, pub.device_id)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise SideChannelError("side channel closed mid-frame")
        buf += chunk
    return bytes(buf)


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("!I", len(payload)) + payload)


def _recv_frame(sock: socket.socket) -> bytes:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    if n > MAX_FRAME_BYTES:
        raise SideChannelError(f"frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
    return _recv_exact(sock, n)


def _ask(host: str, port: int, request: SideChannelRequest, decoder, timeout_s: float):
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise SideChannelError(f"bad side-channel port {port!r}")
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            _send_frame(sock, _encoder.encode(request))
            return decoder.decode(_recv_frame(sock))
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise SideChannelError(f"side channel {host}:{port}: {e}") from e


def fetch_publication(host: str, port: int, timeout_s: float = SOCKET_TIMEOUT_S) -> tuple[AgentPublication, PoolLayout]:
    """Ask a peer's side channel for its publication; validated before it is returned."""
    pub = _ask(host, port, SideChannelRequest(op="publication"), _pub_decoder, timeout_s)
    return pub, validate_publication(pub)


def fetch_lease_status(host: str, port: int, request_id: str, epoch: int, reader: str,
                       timeout_s: float = SOCKET_TIMEOUT_S) -> str:
    req = SideChannelRequest(op="lease_status", request_id=request_id, epoch=epoch, reader=reader)
    status = _ask(host, port, req, _status_decoder, timeout_s).status
    if status not in ("held", "read", "gone"):
        raise SideChannelError(f"bad lease status {status!r}")
    return status


def open_link(host: str, port: int, timeout_s: float = SOCKET_TIMEOUT_S) -> tuple[AgentPublication, PoolLayout, "PeerLink"]:
    """Connect to a peer's side channel, fetch and validate its publication, and keep the connection open
    for lease queries. Blocking: run it off the engine loop."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise SideChannelError(f"bad side-channel port {port!r}")
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:
        raise SideChannelError(f"side channel {host}:{port}: {e}") from e
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send_frame(sock, _encoder.encode(SideChannelRequest(op="publication")))
        pub = _pub_decoder.decode(_recv_frame(sock))
        layout = validate_publication(pub)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError, SideChannelError) as e:
        sock.close()
        raise SideChannelError(f"side channel {host}:{port}: {e}") from e
    return pub, layout, PeerLink(sock)


class PeerLink:
    """A kept-open side-channel connection used for lease queries without blocking: `ask` queues a frame,
    `answers` returns whatever has arrived. Not thread-safe: the owner serialises calls."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        self._sock = sock
        self._in = bytearray()
        self._out = bytearray()
        self.closed = False

    def fileno(self) -> int:
        return self._sock.fileno()

    def ask(self, request_id: str, epoch: int, reader: str, pin_s: float = 0.0) -> None:
        payload = _encoder.encode(SideChannelRequest("lease_status", request_id, epoch, reader, pin_s))
        self._out += struct.pack("!I", len(payload)) + payload
        self._flush()

    def _flush(self) -> None:
        while self._out:
            try:
                n = self._sock.send(self._out)
            except BlockingIOError:
                return
            except OSError as e:
                raise self._broken(f"send failed: {e}") from e
            del self._out[:n]

    def answers(self) -> list[LeaseStatus]:
        """Answers received so far (in request order). Raises SideChannelError once the link is unusable."""
        if self.closed:
            raise SideChannelError("side channel link closed")
        self._flush()
        while True:
            try:
                chunk = self._sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                raise self._broken(f"receive failed: {e}") from e
            if not chunk:
                raise self._broken("peer closed the side channel")
            self._in += chunk
            if len(self._in) > MAX_FRAME_BYTES:
                raise self._broken("peer sent too much")
        out = []
        while len(self._in) >= 4:
            (n,) = struct.unpack_from("!I", self._in)
            if n > MAX_FRAME_BYTES:
                raise self._broken(f"frame of {n} bytes")
            if len(self._in) < 4 + n:
                break
            frame = bytes(self._in[4:4 + n])
            del self._in[:4 + n]
            try:
                ans = _status_decoder.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise self._broken(f"bad answer: {e}") from e
            if ans.status not in ("held", "read", "gone") or not 0 <= ans.pinned_s < 1e6:
                raise self._broken(f"bad lease status {ans.status!r}")
            out.append(ans)
        return out

    def alive(self) -> bool:
        """False once the peer closed or reset the connection (idle timeout, restart): reconnect then."""
        if self.closed:
            return False
        try:
            readable = select.select([self._sock], [], [], 0)[0]
            if readable and not self._sock.recv(1, socket.MSG_PEEK):
                self.close()
                return False
        except (BlockingIOError, InterruptedError):
            return True
        except (OSError, ValueError):
            self.close()
            return False
        return True

    def _broken(self, why: str) -> SideChannelError:
        self.close()
        return SideChannelError(f"side channel link: {why}")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._sock.close()


class SideChannelServer:
    """Serves one publication on a TCP port in a daemon thread; each connection is handled in its own thread
    so that a slow client cannot block others, and may carry many requests (decode keeps one open)."""

    def __init__(self, publication: AgentPublication, lease_status=None, host: str = "127.0.0.1", port: int = 0,
                 lease_pin=None):
        self._payload = _encoder.encode(publication)
        self._lease_status = lease_status  # (request_id, epoch, reader) -> status; must be thread-safe
        self._lease_pin = lease_pin  # (request_id, epoch, reader, pin_s) -> (status, pinned_s); thread-safe
        self._connections = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._open: set[socket.socket] = set()  # kept-open connections, closed with the server
        self._open_lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(64)
        self.host, self.port = self._sock.getsockname()[:2]
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="kv-side-channel", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if not self._connections.acquire(blocking=False):
                conn.close()  # too many open connections: refuse rather than start unbounded threads
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._open_lock:
            self._open.add(conn)
        try:
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while not self._closed:
                    conn.settimeout(IDLE_TIMEOUT_S)
                    header = conn.recv(4, socket.MSG_PEEK)
                    if not header:
                        return
                    conn.settimeout(SOCKET_TIMEOUT_S)  # a started frame must arrive whole, promptly
                    req = _req_decoder.decode(_recv_frame(conn))
                    if req.op == "publication":
                        _send_frame(conn, self._payload)
                    elif req.op == "lease_status" and self._lease_status is not None:
                        pinned_s = 0.0
                        if req.pin_s > 0 and self._lease_pin is not None:
                            status, pinned_s = self._lease_pin(req.request_id, req.epoch, req.reader, req.pin_s)
                        else:
                            status = self._lease_status(req.request_id, req.epoch, req.reader)
                        _send_frame(conn, _encoder.encode(LeaseStatus(status, req.request_id, req.epoch, pinned_s)))
                    else:
                        return
        except (OSError, SideChannelError, msgspec.DecodeError, msgspec.ValidationError):
            return  # a bad client gets a closed connection, nothing else
        finally:
            with self._open_lock:
                self._open.discard(conn)
            self._connections.release()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=2)
        with self._open_lock:  # clients' kept-open links see EOF now, not a server that no longer answers
            for conn in self._open:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
