"""Direct channels between actors (``runtime.channels``, the Ray executor's
``transport="direct"``): frames carry arrays exactly, only to a peer with the token, and a
send to a receiver that is gone fails fast, naming it."""

from __future__ import annotations

import doctest
import socket
import time

import ml_dtypes
import numpy as np
import pytest

from rhino.runtime import channels as channels_module
from rhino.runtime.channels import ChannelServer, Channels


@pytest.fixture
def server():
    got: list = []
    s = ChannelServer(b"token", lambda *a: got.append(a), "127.0.0.1")
    s.got = got
    yield s
    s.close()


def test_doctests():
    assert doctest.testmod(channels_module).failed == 0


def test_arrays_arrive_exactly_with_their_keys(server):
    values = [np.float32(3.5), np.arange(12, dtype=np.int64).reshape(3, 4).T,
              np.linspace(0, 1, 6).astype(ml_dtypes.bfloat16).reshape(2, 3),
              np.zeros((0, 4), np.float16), np.random.default_rng(0).random((64, 1024))]
    keys = [(1, 0), (1, "acc"), (2, None), ("arg", 3, 9), (5, 3)]
    out = Channels(b"token")
    for k, v in zip(keys, values):
        out.send(server.address, 7, 1, k, np.asarray(v), 5.0)
    assert server.wait_frames(len(values), 10.0)
    assert [g[:3] for g in server.got] == [(7, 1, k) for k in keys]
    for (_, _, _, a), v in zip(server.got, values):
        v = np.asarray(v)
        assert a.dtype == v.dtype and a.shape == v.shape
        np.testing.assert_array_equal(a, v)
    assert out.sent_bytes == sum(np.asarray(v).nbytes for v in values)
    out.close()


def test_a_connection_without_the_token_is_closed_unread(server):
    try:   # the send itself may fail: the server may close before the frame is written
        Channels(b"wrong").send(server.address, 1, 0, (1, 0), np.ones(3), 5.0)
    except ConnectionError:
        pass
    deadline = time.monotonic() + 5
    while not server.errors and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.errors == ["a connection without the executor's token was closed"]
    assert server.got == [] and server.frames == 0


def test_a_send_to_a_receiver_that_is_gone_fails_fast_naming_it():
    with socket.socket() as s:   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"sending 24 bytes to {address}"):
        Channels(b"t").send(address, 1, 0, (1, 0), np.ones(3), 2.0)
    assert time.monotonic() - t0 < 5


def test_a_broken_connection_fails_the_send_and_is_forgotten():
    got: list = []
    first = ChannelServer(b"t", lambda *a: got.append(a), "127.0.0.1")
    out = Channels(b"t")
    out.send(first.address, 1, 0, (1, 0), np.ones(2), 5.0)
    assert first.wait_frames(1, 5.0)
    first.close()
    with pytest.raises(ConnectionError):   # the old connection is dead: the send fails ...
        for _ in range(50):   # (the first writes may still go into the socket's buffer)
            out.send(first.address, 1, 0, (1, 1), np.ones(1 << 16), 1.0)
            time.sleep(0.02)
    assert first.address not in out._conns   # ... and is forgotten
    out.close()


def test_a_prng_key_travels_as_its_bits_and_comes_back_a_key():
    import jax

    from rhino.runtime.channels import PackedKey, pack_key, unpack_key

    got = []
    server = ChannelServer(b"k", lambda *a: got.append(a), "127.0.0.1")
    keys = jax.random.split(jax.random.key(3), 4)
    try:
        Channels(b"k").send(server.address, 1, 0, (9, 0), pack_key(keys), 5.0)
        assert server.wait_frames(1, 5.0)
    finally:
        server.close()
    (step, src, key, value), = got
    assert isinstance(value, PackedKey) and (step, src, key) == (1, 0, (9, 0))
    back = unpack_key(value)
    assert jax.dtypes.issubdtype(back.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(back), jax.random.key_data(keys))
