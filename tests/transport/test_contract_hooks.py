"""What upper layers ask transports through the contract instead of naming them: staging rings,
export sizes, doctor's diagnoses, library statuses; and the registry's check of the new
capability."""

from __future__ import annotations

import pytest
import torch

import tensorwire as tw
from tensorwire.errors import TransportContractError
from tensorwire.transport import register_transport, unregister_transport
from tensorwire.transport.contract import Capabilities, Diagnosis, Health, Transport
from tensorwire.transport.registry import check_contract, library_report


class _Rings(Transport):
    name = "test_rings"
    capabilities = Capabilities(
        one_sided=True, same_process=True, same_node=False, cross_node=False, staging_rings=True
    )

    def fetch(self, request, dst):  # pragma: no cover - never fetched
        raise AssertionError


class _Broken(Transport):
    name = "test_broken_diag"
    capabilities = Capabilities(one_sided=True, same_process=True, same_node=False, cross_node=False)

    @classmethod
    def library_status(cls) -> str:
        raise RuntimeError("no such library")

    def diagnose(self) -> list[Diagnosis]:
        raise RuntimeError("probe crashed")

    def fetch(self, request, dst):  # pragma: no cover - never fetched
        raise AssertionError


def test_staging_rings_require_their_methods():
    with pytest.raises(TransportContractError, match=r"staging_ring.*staging_rings=True"):
        check_contract(_Rings)


def test_the_staging_transport_offers_rings_its_readers_map(agent):
    staging = agent.staging()
    assert staging is not None and staging.capabilities.staging_rings and staging.name == "shm"
    ring = staging.staging_ring(4096)
    reader = staging.ring_reader()
    try:
        ring.write(1, [torch.arange(16, dtype=torch.uint8)])
        mapped = reader.mapped(ring.names[1], 4096)
        assert bytes(mapped[:16]) == bytes(range(16))
    finally:
        reader.close()
        ring.close()


def test_reads_in_place_weighs_direct_reads_against_the_ring(agent, monkeypatch):
    from tensorwire.transport.backends.shm import cma

    staging = agent.staging()
    speed = cma.speed_vs_memcpy()
    assert 0 < speed < 10  # measured: process_vm_readv's speed as a share of memcpy's
    monkeypatch.setattr(cma, "_speed", [0.5])  # a VM where page pinning traps: never in place
    assert [staging.reads_in_place(n) for n in (1, 2, 8)] == [False, False, False]
    monkeypatch.setattr(cma, "_speed", [0.8])  # in place for up to 3 readers (n < 0.8 (n + 1))
    assert [staging.reads_in_place(n) for n in (1, 3, 4)] == [cma.enabled(), cma.enabled(), False]
    monkeypatch.setenv("TENSORWIRE_SHM_DIRECT", "0")
    assert not staging.reads_in_place(1)  # no direct reads: the ring


def test_export_nbytes_counts_a_segment_only_once_made(agent, worker):
    value = torch.randn(64 << 10)
    ref = tw.put(value)
    desc = ref.state.desc
    before = agent.export_nbytes(desc)
    assert worker.call("tests.helpers.tasks:get_transport", ref, transport="shm", view=True)[1] == "shm"
    assert agent.export_nbytes(desc) == desc.packed_nbytes  # a view maps the segment: it exists now
    assert before in (0, desc.packed_nbytes)  # 0 where direct reads make the segment lazily


def test_a_plugins_failing_diagnose_and_library_are_reported_not_raised(agent):
    register_transport(_Broken.name, _Broken)
    try:
        report = agent.diagnose()
        failed = Diagnosis(_Broken.name, Health.FAIL, "diagnose() failed: RuntimeError: probe crashed")
        assert report[_Broken.name] == [failed]
        assert any(d.check == "shm direct reads" for d in report["shm"])
        libraries = library_report()
        assert libraries[_Broken.name] == "cannot be loaded: RuntimeError: no such library"
        assert libraries["gloo"] in ("available", "not built into torch")
    finally:
        unregister_transport(_Broken.name)
