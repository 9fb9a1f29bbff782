"""Shared links: concurrent KV copies split a link's achievable bandwidth (processor sharing)."""

from __future__ import annotations

import pytest

from kvcap.sim.links import Link, LinkSet


def test_link_is_shared_by_concurrent_transfers():
    links = LinkSet()
    nic = links.add(Link("nic0", "nic", 12.5e9, 10e9, 1e-3))
    done: list[float] = []
    links.start(0.0, 1e9, [nic], [], True, lambda t: done.append(t))
    links.start(0.0, 1e9, [nic], [], True, lambda t: done.append(t))
    t, tr = links.next_done()
    assert t == pytest.approx(0.2)  # two 1 GB copies share 10 GB/s: both finish at 0.2 s
    links.advance(t)
    links.finish(tr)
    t2, _ = links.next_done()
    assert t2 == pytest.approx(0.2)
    assert tr.latency_s == 1e-3
    assert nic.moved_bytes == pytest.approx(2e9)
