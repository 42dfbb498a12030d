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
NIXL read the wrong bytes without complaint. The pin carries decode's claim (block ids + token hash), which
the producer checks against the lease (leases.claim_mismatch) and answers "refused" when it differs.

Authentication (a shared secret: `--kv-side-channel-secret` / SPLITSERVE_KV_SECRET): the first frames of a
connection are an HMAC-SHA256 challenge-response in both directions. The client sends `{"op": "auth",
"nonce": Nc}`; the server answers `{"nonce": Ns, "proof": HMAC(K, server|Nc|Ns)}`; the client checks it and
sends `{"op": "auth", "proof": HMAC(K, client|Ns|Nc)}`. A server with a secret drops a connection whose
first frame is anything else, or whose proof is wrong, before it reads another frame; a client with a
secret refuses a server that cannot prove it knows the secret (it never trusts an unproven publication).
Connections are bounded: at most MAX_PER_ADDRESS per client address and MAX_CONNECTIONS in all; when full,
the oldest connection that has not authenticated (then the longest idle one) is closed to make room, so
idle or half-open connections cannot lock new peers out. A connection must authenticate (or, without a
secret, send its first request) within HANDSHAKE_TIMEOUT_S and is closed after IDLE_TIMEOUT_S idle.
Errors a caller could see are generic (UNREACHABLE): they never tell an open port from a closed one.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import select
import socket
import struct
import threading
import time

import msgspec

from token_engine.kv_connector.descriptors import DTYPE_SIZES, KVGeometry, PoolLayout
from token_engine.kv_connector.peers import AllowedPeers, PeerNotAllowed

log = logging.getLogger("token_engine.kv_transfer")

MAX_FRAME_BYTES = 1 << 20
MAX_METADATA_BYTES = 256 << 10
MAX_BLOCKS = 1 << 24
SOCKET_TIMEOUT_S = 5.0
HANDSHAKE_TIMEOUT_S = 5.0  # a new connection authenticates (or sends its first request) within this
IDLE_TIMEOUT_S = 120.0  # a kept-open connection with no request for this long is closed by the server
MAX_CONNECTIONS = 256
MAX_PER_ADDRESS = 16
NONCE_BYTES = 32
_SERVER_LABEL = b"splitserve-kv-side-channel-server\x00"
_CLIENT_LABEL = b"splitserve-kv-side-channel-client\x00"
UNREACHABLE = "could not reach the KV peer's side channel (unreachable, not a side channel, or it refused us)"
NOT_ALLOWED = "remote_host is not an allowed KV peer (--kv-allowed-peers)"


class SideChannelError(Exception):
    """The peer's side channel is unreachable or sent something we refuse to use. `str()` is what a caller
    may see (generic on first contact); `detail` is for the operator's log."""

    def __init__(self, message: str, detail: str | None = None, reason: str = "side_channel"):
        super().__init__(message)
        self.detail = detail or message
        self.reason = reason


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
    block_ids: list[int] | None = None  # the claim: every block id decode was given for the lease
    token_hash: str = ""  # the claim: the token hash decode was given (and checked against its prompt)
    nonce: str = ""  # auth: the client's challenge (hex)
    proof: str = ""  # auth: the client's answer to the server's challenge (hex)
    # push mode (op "push_register"): decode's reservation of block_ids for prompt blocks [first, ...) of
    # request_id, holding KV for its first num_tokens tokens (token_hash); `publication` is decode's agent
    first: int = 0
    num_tokens: int = 0
    publication: AgentPublication | None = None


class AuthAnswer(msgspec.Struct, forbid_unknown_fields=True):
    nonce: str  # the server's challenge (hex)
    proof: str  # HMAC over the client's challenge: the server knows the secret


STATUSES = ("held", "read", "gone", "refused")


class LeaseStatus(msgspec.Struct, forbid_unknown_fields=True):
    # "held" | "read" (ended by this reader's READ) | "gone" (expired, unknown, other reader) |
    # "refused" (the claim does not match the lease)
    status: str
    request_id: str = ""
    epoch: int = 0
    pinned_s: float = 0.0  # how long the lease is pinned to the asking reader (pin requests only)


_encoder = msgspec.json.Encoder()
_pub_decoder = msgspec.json.Decoder(AgentPublication)
_req_decoder = msgspec.json.Decoder(SideChannelRequest)
_status_decoder = msgspec.json.Decoder(LeaseStatus)
_auth_decoder = msgspec.json.Decoder(AuthAnswer)


def _proof(secret: bytes, label: bytes, first: bytes, second: bytes) -> str:
    return hmac.new(secret, label + first + second, hashlib.sha256).hexdigest()


def _unhex_nonce(text: str) -> bytes:
    nonce = bytes.fromhex(text)
    if len(nonce) != NONCE_BYTES:
        raise ValueError("bad nonce length")
    return nonce


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


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes, all of them by ``deadline`` (monotonic): a socket timeout bounds one recv, so a peer
    sending a byte now and then would otherwise hold the connection as long as it likes."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SideChannelError("side channel peer too slow: the frame did not arrive in time")
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise SideChannelError("side channel closed mid-frame")
        buf += chunk
    return bytes(buf)


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("!I", len(payload)) + payload)


def _recv_frame(sock: socket.socket, deadline: float) -> bytes:
    """One whole frame by ``deadline``; the socket's timeout is left at what remained."""
    (n,) = struct.unpack("!I", _recv_exact(sock, 4, deadline))
    if n > MAX_FRAME_BYTES:
        raise SideChannelError(f"frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
    return _recv_exact(sock, n, deadline)


def _check_port(port) -> None:
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise SideChannelError(f"bad side-channel port {port!r}", reason="bad_request")


def _connect(host: str, port: int, timeout_s: float, secret: bytes | None,
             allowed: AllowedPeers | None) -> socket.socket:
    """A connected, authenticated (when `secret`) socket to an allowed peer. Blocking: off the engine loop.
    Every failure after the allowlist is the same generic error; the detail goes to the log."""
    _check_port(port)
    allowed = allowed if allowed is not None else AllowedPeers()
    try:
        family, sockaddr = allowed.resolve(host, port)
    except PeerNotAllowed:
        raise SideChannelError(NOT_ALLOWED, f"{host}:{port} is not on the allowlist {allowed!r}",
                               reason="not_allowed") from None
    except OSError as e:
        raise SideChannelError(UNREACHABLE, f"{host}:{port}: {e}") from e
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(sockaddr)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if secret:
            _client_handshake(sock, secret, time.monotonic() + timeout_s)
        return sock
    except (OSError, ValueError, SideChannelError, msgspec.DecodeError, msgspec.ValidationError) as e:
        sock.close()
        raise SideChannelError(UNREACHABLE, f"{host}:{port}: {getattr(e, 'detail', None) or e}") from e


def _client_handshake(sock: socket.socket, secret: bytes, deadline: float) -> None:
    mine = secrets.token_bytes(NONCE_BYTES)
    _send_frame(sock, _encoder.encode(SideChannelRequest(op="auth", nonce=mine.hex())))
    answer = _auth_decoder.decode(_recv_frame(sock, deadline))
    theirs = _unhex_nonce(answer.nonce)
    if not hmac.compare_digest(answer.proof, _proof(secret, _SERVER_LABEL, mine, theirs)):
        raise SideChannelError("the peer could not prove it knows the side-channel secret")
    _send_frame(sock, _encoder.encode(SideChannelRequest(op="auth", proof=_proof(secret, _CLIENT_LABEL, theirs, mine))))


def _ask(host: str, port: int, request: SideChannelRequest, decoder, timeout_s: float,
         secret: bytes | None = None, allowed: AllowedPeers | None = None):
    sock = _connect(host, port, timeout_s, secret, allowed)
    try:
        with sock:
            _send_frame(sock, _encoder.encode(request))
            return decoder.decode(_recv_frame(sock, time.monotonic() + timeout_s))
    except (OSError, SideChannelError, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise SideChannelError(UNREACHABLE, f"{host}:{port}: {e}") from e


def fetch_publication(host: str, port: int, timeout_s: float = SOCKET_TIMEOUT_S, secret: bytes | None = None,
                      allowed: AllowedPeers | None = None) -> tuple[AgentPublication, PoolLayout]:
    """Ask a peer's side channel for its publication; validated before it is returned."""
    pub = _ask(host, port, SideChannelRequest(op="publication"), _pub_decoder, timeout_s, secret, allowed)
    return pub, validate_publication(pub)


def fetch_lease_status(host: str, port: int, request_id: str, epoch: int, reader: str,
                       timeout_s: float = SOCKET_TIMEOUT_S, secret: bytes | None = None,
                       allowed: AllowedPeers | None = None) -> str:
    req = SideChannelRequest(op="lease_status", request_id=request_id, epoch=epoch, reader=reader)
    status = _ask(host, port, req, _status_decoder, timeout_s, secret, allowed).status
    if status not in STATUSES:
        raise SideChannelError(f"bad lease status {status!r}")
    return status


def open_link(host: str, port: int, timeout_s: float = SOCKET_TIMEOUT_S, secret: bytes | None = None,
              allowed: AllowedPeers | None = None) -> tuple[AgentPublication, PoolLayout, PeerLink]:
    """Connect to an allowed peer's side channel (authenticated when `secret`), fetch and validate its
    publication, and keep the connection open for lease queries. Blocking: run it off the engine loop."""
    sock = _connect(host, port, timeout_s, secret, allowed)
    try:
        _send_frame(sock, _encoder.encode(SideChannelRequest(op="publication")))
        pub = _pub_decoder.decode(_recv_frame(sock, time.monotonic() + timeout_s))
        layout = validate_publication(pub)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError, SideChannelError) as e:
        sock.close()
        raise SideChannelError(UNREACHABLE, f"{host}:{port}: {getattr(e, 'detail', None) or e}") from e
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

    def ask(self, request_id: str, epoch: int, reader: str, pin_s: float = 0.0, block_ids=None,
            token_hash: str = "") -> None:
        """Queue a lease question; with pin_s > 0 it is decode's claim (block ids + token hash) and pin."""
        self._queue(SideChannelRequest("lease_status", request_id, epoch, reader, pin_s,
                                       list(block_ids) if block_ids is not None else None, token_hash))

    def register_push(self, request_id: str, epoch: int, reader: str, pin_s: float, block_ids: list[int],
                      token_hash: str, first: int, num_tokens: int, publication: AgentPublication) -> None:
        """Queue decode's push reservation (answered "held" when prefill accepted it, else "refused")."""
        self._queue(SideChannelRequest("push_register", request_id, epoch, reader, pin_s, list(block_ids),
                                       token_hash, first=first, num_tokens=num_tokens, publication=publication))

    def cancel_push(self, request_id: str, epoch: int, reader: str) -> None:
        """Queue the withdrawal of a reservation: "gone" once prefill will never write into it, "held" while
        a WRITE of it is still in flight (a `pushfail` notification follows when it ends)."""
        self._queue(SideChannelRequest("push_cancel", request_id, epoch, reader))

    def _queue(self, request: SideChannelRequest) -> None:
        payload = _encoder.encode(request)
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
            if ans.status not in STATUSES or not 0 <= ans.pinned_s < 1e6:
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


class _Conn:
    """One accepted connection, as the server's connection limits see it."""

    __slots__ = ("sock", "addr", "last", "authed", "busy")

    def __init__(self, sock: socket.socket, addr: str):
        self.sock = sock
        self.addr = addr
        self.last = time.monotonic()
        self.authed = False  # authenticated (with a secret) or served one valid request (without)
        self.busy = False  # a request is being answered

    def kick(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes its thread's recv, which then closes it
        except OSError:
            pass


class SideChannelServer:
    """Serves one publication on a TCP port in a daemon thread; each connection is handled in its own thread
    so that a slow client cannot block others, and may carry many requests (decode keeps one open).
    With `secret`, every connection must pass the HMAC handshake before anything else is read."""

    def __init__(self, publication: AgentPublication, lease_status=None, host: str = "127.0.0.1", port: int = 0,
                 lease_pin=None, secret: bytes | None = None, push=None):
        self._payload = _encoder.encode(publication)
        self._lease_status = lease_status  # (request_id, epoch, reader) -> status; must be thread-safe
        # (request_id, epoch, reader, pin_s, block_ids, token_hash) -> (status, pinned_s); thread-safe
        self._lease_pin = lease_pin
        self._push = push  # (SideChannelRequest) -> (status, pinned_s) for push_register / push_cancel; thread-safe
        self._secret = secret or None
        self._conns: set[_Conn] = set()
        self._conns_lock = threading.Lock()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:  # one line for the operator, naming the knob (see kv_connector/config.py)
            self._sock.close()
            raise OSError(f"the NIXL side channel cannot listen on {host}:{port} ({exc.strerror or exc}): set "
                          f"VLLM_NIXL_SIDE_CHANNEL_PORT (and VLLM_NIXL_SIDE_CHANNEL_HOST) to a free address") from None
        self._sock.listen(64)
        self.host, self.port = self._sock.getsockname()[:2]
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="kv-side-channel", daemon=True)
        self._thread.start()

    def connection_count(self) -> int:
        with self._conns_lock:
            return len(self._conns)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return
            conn = _Conn(sock, addr[0])
            with self._conns_lock:
                admitted = self._make_room(conn.addr)
                if admitted:
                    self._conns.add(conn)
            if not admitted:
                sock.close()  # every connection is mid-request: refuse rather than start unbounded threads
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _make_room(self, addr: str) -> bool:
        """Under the lock: whether a new connection from `addr` fits, closing the stalest one if needed
        (not yet authenticated first, then the longest idle; never one answering a request)."""
        same = [c for c in self._conns if c.addr == addr]
        if len(same) >= MAX_PER_ADDRESS:
            pool = same
        elif len(self._conns) >= MAX_CONNECTIONS:
            pool = list(self._conns)
        else:
            return True
        idle = [c for c in pool if not c.busy]
        if not idle:
            return False
        victim = min(idle, key=lambda c: (c.authed, c.last))
        self._conns.discard(victim)
        victim.kick()
        return True

    def _handshake(self, conn: socket.socket, deadline: float) -> None:
        """Server half of the HMAC challenge-response; raises (and the connection is dropped) on anything
        but a correct client proof, before any other frame is read."""
        secret = self._secret
        assert secret is not None  # only called when a secret is configured
        hello = _req_decoder.decode(self._recv_by(conn, deadline))
        if hello.op != "auth" or not hello.nonce:
            raise SideChannelError("unauthenticated side-channel client")
        theirs = _unhex_nonce(hello.nonce)
        mine = secrets.token_bytes(NONCE_BYTES)
        _send_frame(conn, _encoder.encode(AuthAnswer(mine.hex(), _proof(secret, _SERVER_LABEL, theirs, mine))))
        answer = _req_decoder.decode(self._recv_by(conn, deadline))
        if answer.op != "auth" or not hmac.compare_digest(answer.proof, _proof(secret, _CLIENT_LABEL, mine, theirs)):
            raise SideChannelError("side-channel client failed authentication")

    @staticmethod
    def _recv_by(conn: socket.socket, deadline: float) -> bytes:
        return _recv_frame(conn, deadline)

    def _serve(self, c: _Conn) -> None:
        conn = c.sock
        try:
            with conn:
                deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
                if self._secret is not None:
                    self._handshake(conn, deadline)
                    c.authed = True
                while not self._closed:
                    conn.settimeout(IDLE_TIMEOUT_S if c.authed else max(0.001, deadline - time.monotonic()))
                    header = conn.recv(4, socket.MSG_PEEK)
                    if not header:
                        return
                    c.busy = True
                    # a started frame must arrive whole, promptly (not a byte now and then)
                    req = _req_decoder.decode(_recv_frame(conn, time.monotonic() + SOCKET_TIMEOUT_S))
                    conn.settimeout(SOCKET_TIMEOUT_S)  # for the answer
                    if req.op == "publication":
                        _send_frame(conn, self._payload)
                    elif req.op == "lease_status" and self._lease_status is not None:
                        pinned_s = 0.0
                        if req.pin_s > 0 and self._lease_pin is not None:
                            status, pinned_s = self._lease_pin(req.request_id, req.epoch, req.reader, req.pin_s,
                                                               req.block_ids, req.token_hash)
                        else:
                            status = self._lease_status(req.request_id, req.epoch, req.reader)
                        _send_frame(conn, _encoder.encode(LeaseStatus(status, req.request_id, req.epoch, pinned_s)))
                    elif req.op in ("push_register", "push_cancel") and self._push is not None:
                        status, pinned_s = self._push(req)
                        _send_frame(conn, _encoder.encode(LeaseStatus(status, req.request_id, req.epoch, pinned_s)))
                    else:
                        return
                    c.authed, c.busy, c.last = True, False, time.monotonic()
        except (OSError, ValueError, SideChannelError, msgspec.DecodeError, msgspec.ValidationError):
            return  # a bad or unauthenticated client gets a closed connection, nothing else
        finally:
            with self._conns_lock:
                self._conns.discard(c)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=2)
        with self._conns_lock:  # clients' kept-open links see EOF now, not a server that no longer answers
            for c in self._conns:
                c.kick()
