"""Cross-mesh resharding between processes (``runtime.transfer.process_resharding``), its plan and
pieces checked in one process with hosts pretended (two devices per host): every layout pair
of 004's kinds arrives exact, each process sends only what its devices hold and each
receiving host gets each region once (the broadcast plan)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rhino.runtime.transfer import process_resharding as pr
def host_of(d):
    return int(d.id) // 2          # pretend: devices 0-1 host 0, 2-3 host 1, ...


def _mesh(ids, shape, names):
    devs = jax.devices()
    return Mesh(np.array([devs[i] for i in ids]).reshape(shape), names)


CASES = [
    ((0, 1, 2, 3), (2, 2), ("a", "b"), P("a", "b"), (4, 5, 6, 7), (4,), ("x",), P("x")),
    ((0, 1, 2, 3), (4,), ("x",), P(None, "x"), (4, 5, 6, 7), (2, 2), ("a", "b"),
     P("b", "a")),
    ((0, 1), (2,), ("x",), P("x"), (4, 5, 6, 7), (4,), ("x",), P()),   # to replicated
    ((0, 1, 2, 3), (4,), ("x",), P(), (4, 5), (2,), ("x",), P(None, "x")),
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_pieces_between_pretended_processes_arrive_exact(case):
    si, ss, sn, sp, di, ds, dn, dp = case
    value = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    src = NamedSharding(_mesh(si, ss, sn), sp)
    dst = NamedSharding(_mesh(di, ds, dn), dp)
    x = jax.device_put(value, src)
    plan = pr.process_plan(src, dst, value.shape, 4, host_of)
    senders = sorted({host_of(jax.devices()[i]) for i in si})
    receivers = sorted({host_of(jax.devices()[i]) for i in di})
    sent = {p: pr.offers(plan, x, p) for p in senders}
    pieces = {}
    for q in receivers:
        want = pr.wanted(plan, dst, x.dtype, q)
        received = {p: [jax.device_put(a, dev) for a, (_, dev) in
                        zip(sent[p].get(q, []), want.get(p, []))] for p in senders}
        for p in senders:
            assert len(received[p]) == len(want.get(p, []))
            for a, (region, _) in zip(received[p], want.get(p, [])):
                np.testing.assert_array_equal(
                    np.asarray(a), value[tuple(slice(lo, hi) for lo, hi in region)])
        pieces.update(pr.assemble_pieces(plan, dst, received, q, x.dtype))
    out = jax.make_array_from_single_device_arrays(value.shape, dst, list(pieces.values()))
    np.testing.assert_array_equal(np.asarray(out), value)
    assert out.sharding == dst
    # Each receiving host gets each of its regions once, however many devices need it.
    cross = [c for c in plan.copies() if c.cross_host]
    per_host = [(plan.dst_mesh.host_of(c.dst_device), c.region) for c in cross]
    assert len(per_host) == len(set(per_host))


def test_a_missing_shard_is_named():
    src = NamedSharding(_mesh((0, 1), (2,), ("x",)), P("x"))
    dst = NamedSharding(_mesh((4, 5), (2,), ("x",)), P())
    x = jax.device_put(np.ones((4, 2), np.float32), src)
    plan = pr.process_plan(src, dst, (4, 2), 4, host_of)
    other = jax.device_put(np.ones((4, 2), np.float32),
                           NamedSharding(_mesh((2, 3), (2,), ("x",)), P("x")))
    with pytest.raises(pr.ReshardingError, match=r"which this process does not hold"):
        pr.offers(plan, other, 0)
    assert pr.offers(plan, x, 0)



@pytest.mark.parametrize("case", [
    ((4,), ("x",), P("x"), (4,), ("x",), P(), "gathered", 4),
    ((4,), ("x",), P(None, "x"), (2, 2), ("a", "b"), P("a", "b"), "another split", 4),
    ((2, 2), ("a", "b"), P("b", "a"), (4,), ("x",), P("x"), "same layout", 4),
    ((2, 2), ("a", "b"), P("a"), (4,), ("x",), P(), "replicated twice", 2),
    ((4,), ("x",), P(), (2, 2), ("a", "b"), P("b"), "replicated four times", 1),
], ids=lambda c: c[-2] if isinstance(c, tuple) else str(c))
@pytest.mark.parametrize("put_bytes", [1 << 20, 0], ids=["put", "program"])
def test_equal_meshes_cross_as_the_sources_tiles_and_change_layout_on_arrival(
        case, put_bytes, monkeypatch):
    """``relayout``: each distinct tile of the source crosses once, onto the target's
    device of the same index, is copied on to its other holders' indices, and the
    receiving process makes the target layout (a ``device_put`` for small values, a
    compiled identity above ``_PUT_BYTES``); exact, with the target's own sharding."""
    monkeypatch.setattr(pr, "_PUT_BYTES", put_bytes)
    ss, sn, sp, ds, dn, dp, _, distinct = case
    value = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    src = NamedSharding(_mesh((0, 1, 2, 3), ss, sn), sp)
    dst = NamedSharding(_mesh((4, 5, 6, 7), ds, dn), dp)
    x = jax.device_put(value, src)
    short = pr.relayout(src, dst, value.shape)
    assert short is not None
    assert [d.id for d in short.mid.mesh.devices.flat] == \
        [d.id for d in dst.mesh.devices.flat]
    sent = pr.relayout_offers(short, x, 0)
    want = pr.relayout_wanted(short, src, value.shape, 0)
    assert len(sent[0]) == len(want[0]) == distinct
    assert sum(a.size for a in sent[0]) == value.size          # each element once
    # the pull: each offered tile onto the device the receiver asks for
    pulled = {0: [jax.device_put(a, dev) for a, (tile, dev) in zip(sent[0], want[0])
                  if a.shape == tile]}
    assert len(pulled[0]) == distinct
    out = pr.relayout_assemble(short, dst, value.shape, pulled)
    assert out.sharding == dst
    np.testing.assert_array_equal(np.asarray(out), value)


def test_relayout_is_not_used_where_the_meshes_differ_in_size():
    """Meshes of other sizes, or a sharding that is not a NamedSharding: None (the general
    plan is used)."""
    four = _mesh((0, 1, 2, 3), (4,), ("x",))
    other = _mesh((4, 5, 6, 7), (4,), ("x",))
    assert pr.relayout(NamedSharding(four, P("x")),
                       NamedSharding(_mesh((4, 5), (2,), ("x",)), P()), (8, 16)) is None
    assert pr.relayout(jax.sharding.SingleDeviceSharding(jax.devices()[0]),
                       NamedSharding(other, P()), (8, 16)) is None
    assert pr.relayout(NamedSharding(four, P("x")), NamedSharding(other, P()),
                       (8, 16)) is not None
