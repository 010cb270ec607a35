"""``tensorwire bench --calibrate``: measure this machine's transports for the selector.

For every transport usable here (except ``local``), a peer process fetches a small value
(the fixed cost) and a large one (the bandwidth) with that transport forced; same-node
transports talk to a peer on this node, the others to a peer that claims another node (so
the cross-node paths are measured). CUDA-only transports use CUDA values when a GPU exists;
``nccl`` needs two GPUs. The table is written for this machine (see
:mod:`tensorwire.transport.hw.calibration`) and every agent started afterwards ranks by it.
"""

from __future__ import annotations

from typing import Any

from tensorwire.peers import OTHER_NODE, SAME_NODE, ask, consumer_device, median_fetch_seconds, peers

__all__ = ["calibrate"]

_SMALL_NBYTES = 4096


def calibrate(nbytes: int = 64 << 20, repeats: int = 5, progress: Any = print) -> tuple[dict[str, Any], list[str]]:
    """Measure every usable transport; returns (costs by transport, notes on what was skipped)."""
    import torch

    import tensorwire as tw
    from tensorwire.runtime.agent import agent as runtime_agent
    from tensorwire.transport import registry
    from tensorwire.transport.contract import MemoryKind
    from tensorwire.transport.selector import CostEstimate

    agent = runtime_agent()
    costs: dict[str, CostEstimate] = {}
    notes: list[str] = []
    with peers(median_fetch_seconds, agent.peer.node_id, "calibrate") as connections:
        for name in registry.registered_transports():
            caps = registry.get_transport_class(name).capabilities
            if caps.carries_value or not (caps.same_node or caps.cross_node):
                continue  # size-limited / same process only: not ranked by these numbers
            if name in agent.unusable_transports():
                notes.append(f"{name}: not usable here ({agent.unusable_transports()[name]})")
                continue
            cuda_only = MemoryKind.HOST not in caps.memory
            device, missing = consumer_device(caps)
            if missing:
                notes.append(f"{name}: {missing}")
                continue
            conn = connections[SAME_NODE if not caps.cross_node else OTHER_NODE]
            seconds = []
            small = agent.config.inline_max_nbytes + _SMALL_NBYTES  # just past inline: a real handle
            for size, count in ((small, max(repeats * 4, 10)), (nbytes, repeats)):
                value = torch.full((size,), 7, dtype=torch.uint8)
                if cuda_only:
                    value = value.cuda()
                status, result = ask(conn, (tw.put(value), name, device, count), timeout_s=300)
                if status == "timeout":
                    raise TimeoutError(f"calibration peer gave no answer for {name}")
                if status != "ok":
                    notes.append(f"{name}: failed ({result})")
                    break
                seconds.append(result)
            if len(seconds) == 2:
                fixed_s, large_s = seconds
                bandwidth = (nbytes - small) / max(large_s - fixed_s, 1e-9) / 1e9
                costs[name] = CostEstimate(fixed_us=round(fixed_s * 1e6, 1), bandwidth_gbps=round(bandwidth, 3))
                progress(f"  {name:9} fixed {fixed_s * 1e6:9.1f} us   bandwidth {bandwidth:8.2f} GB/s")
    return costs, notes
