"""Direct channels between Ray actors: values sent over one TCP connection per pair of
actors, not through the object store and an actor call (the Ray executor's
``transport="direct"``).

Each receiving actor listens on a free port of its node (``ChannelServer``); a sending
actor keeps one connection per receiver (``Channels``), opened on first use. A connection
starts with the executor's token (a random secret the driver hands to its actors): a
connection without it is closed unread. A frame is a small JSON header (step, source
stage, key, dtype, shape) and the array's raw bytes; no pickle crosses the wire.

Only numpy arrays travel (what ``host_value`` makes of a stage's results; a typed PRNG
key array as its bits, with its implementation's name in the header). Every socket
operation has a timeout; a failed send closes its connection (the next send reconnects)
and raises, naming the receiver.

Example:
    >>> import numpy as np
    >>> got = []
    >>> server = ChannelServer(b"secret", lambda *a: got.append(a), "127.0.0.1")
    >>> Channels(b"secret").send(server.address, 3, 0, (7, 1), np.arange(3.0), 5.0)
    >>> server.wait_frames(1, 5.0)
    True
    >>> got[0][:3], got[0][3].tolist()
    ((3, 0, (7, 1)), [0.0, 1.0, 2.0])
    >>> server.close()
"""

from __future__ import annotations

import dataclasses

import json
import socket
import struct
import threading
import time
from typing import Any, Callable

import numpy as np

MAGIC = b"RHC1"
_LEN = struct.Struct("!I")     # header length
_SIZE = struct.Struct("!Q")    # payload bytes


@dataclasses.dataclass(frozen=True)
class PackedKey:
    """A typed PRNG key array on its way to an actor: its bits and implementation."""

    data: np.ndarray
    impl: str


def pack_key(x: Any) -> Any:
    """Typed key arrays as ``PackedKey``, other jax arrays as numpy; the rest unchanged."""
    import jax

    if isinstance(x, jax.Array):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return PackedKey(np.asarray(jax.random.key_data(x)), str(jax.random.key_impl(x)))
        return np.asarray(x)
    return x


def unpack_key(x: Any) -> Any:
    import jax

    if isinstance(x, PackedKey):
        return jax.random.wrap_key_data(x.data, impl=x.impl)
    return x


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:   # bfloat16 and the float8 types live in ml_dtypes
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def _read_exact(conn: socket.socket, n: int, into: memoryview | None = None) -> bytes | None:
    """``n`` bytes from ``conn`` (into ``into`` when given); None at end of stream."""
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = conn.recv_into(buf[got:], n - got)
        if k == 0:
            return None
        got += k
    return buf if into is not None else bytes(buf)


class ChannelServer:
    """Receives frames on ``address`` (``ip:port``) and hands each to
    ``on_value(step, src, key, array)`` on the connection's reader thread.

    Args:
        token: the secret a connection must start with; on_value: the receiver;
        host: the address to listen on (this node's).
    """

    def __init__(self, token: bytes, on_value: Callable[[int, int, tuple, np.ndarray], None],
                 host: str):
        self.token, self.on_value = token, on_value
        self._sock = socket.create_server((host, 0))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._closed = False
        self._cond = threading.Condition()
        self.frames = 0
        self.errors: list[str] = []
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="rhino-channel-accept").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._cond:
                self._conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True,
                             name="rhino-channel-read").start()

    def _read(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(30.0)   # the greeting comes at once
            hello = _read_exact(conn, len(MAGIC) + len(self.token))
            if hello != MAGIC + self.token:
                self._note("a connection without the executor's token was closed")
                return
            conn.settimeout(None)   # frames come when the sender has them
            while True:
                head = _read_exact(conn, _LEN.size)
                if head is None:
                    return
                meta = json.loads(_read_exact(conn, _LEN.unpack(head)[0]))
                (size,) = _SIZE.unpack(_read_exact(conn, _SIZE.size))
                data = bytearray(size)
                if size and _read_exact(conn, size, memoryview(data)) is None:
                    return
                arr = np.frombuffer(data, _dtype(meta["dtype"])).reshape(meta["shape"])
                key = tuple(meta["key"])
                if meta.get("key_impl"):        # a typed PRNG key array's bits
                    arr = PackedKey(arr, meta["key_impl"])
                self.on_value(meta["step"], meta["src"], key, arr)
                with self._cond:
                    self.frames += 1
                    self._cond.notify_all()
        except (OSError, ValueError, KeyError, TypeError) as e:
            if not self._closed:
                self._note(f"{type(e).__name__}: {e}")
        finally:
            conn.close()

    def _note(self, why: str) -> None:
        with self._cond:
            self.errors.append(why)

    def wait_frames(self, n: int, timeout: float) -> bool:
        """Whether ``n`` frames arrived within ``timeout`` seconds (for tests)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.frames < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        with self._cond:
            for c in self._conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                c.close()
            self._conns.clear()


class Channels:
    """The sending side: one connection per receiver address, one sender at a time each.

    Args:
        token: the executor's secret (the receivers check it).
    """

    def __init__(self, token: bytes):
        self.token = token
        self._conns: dict[str, socket.socket] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self.sent_bytes = 0

    def _conn(self, address: str, timeout: float) -> socket.socket:
        conn = self._conns.get(address)
        if conn is None:
            host, port = address.rsplit(":", 1)
            conn = socket.create_connection((host, int(port)), timeout=timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(MAGIC + self.token)
            self._conns[address] = conn
        conn.settimeout(timeout)
        return conn

    def send(self, address: str, step: int, src: int, key: tuple, value: Any,
             timeout: float) -> None:
        """Send ``value`` (a numpy array, or a ``PackedKey``: its bits and implementation)
        to the server at ``address``.

        Raises:
            ConnectionError: the receiver could not be reached or stopped reading within
                ``timeout`` seconds (the connection is closed; the next send reconnects).
        """
        impl = getattr(value, "impl", None)
        arr = np.require(value.data if impl else value, requirements="C")  # 0-d stays 0-d
        head = json.dumps({"step": step, "src": src, "key": list(key), "key_impl": impl,
                           "dtype": arr.dtype.name, "shape": list(arr.shape)}).encode()
        with self._lock:
            lock = self._locks.setdefault(address, threading.Lock())
        with lock:
            try:
                conn = self._conn(address, timeout)
                conn.sendall(_LEN.pack(len(head)) + head + _SIZE.pack(arr.nbytes))
                if arr.nbytes:
                    conn.sendall(arr.reshape(-1).view(np.uint8).data)
            except OSError as e:
                bad = self._conns.pop(address, None)
                if bad is not None:
                    bad.close()
                raise ConnectionError(f"sending {arr.nbytes} bytes to {address}: "
                                      f"{type(e).__name__}: {e}") from e
        self.sent_bytes += arr.nbytes

    def close(self) -> None:
        with self._lock:
            for c in self._conns.values():
                c.close()
            self._conns.clear()
