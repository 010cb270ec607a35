"""``tensorwire`` command line: ``tensorwire topo [--json] [--address ADDR]``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["main"]


def _node_report() -> dict[str, Any]:
    """This node's topology plus the transports its agent can use (runs on any node)."""
    from tensorwire.runtime.ray_env import agent as runtime_agent
    from tensorwire.transport import registry
    from tensorwire.transport.topology import describe_node

    agent = runtime_agent()  # first: under Ray its start-up takes the node id from Ray
    report = describe_node()
    unusable = agent.unusable_transports()
    report["transports"] = {name: unusable.get(name, "usable") for name in registry.registered_transports()}
    return report


def _cluster_reports(address: str) -> list[dict[str, Any]]:
    """One report per alive Ray node, each gathered by a short-lived task pinned to that node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import tensorwire as tw

    tw.init(address=address)
    task = ray.remote(num_cpus=0)(_node_report)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in nodes
    ]
    return ray.get(refs, timeout=120)


def _gib(nbytes: object) -> str:
    return f"{int(nbytes) / 2**30:.1f} GiB" if isinstance(nbytes, int) else "?"


def _print_report(report: dict[str, Any]) -> None:
    shm = report["shared_memory"]
    print(
        f"node {report['node_id']}  (host {report['hostname']}, {report['cpus']} CPUs, "
        f"{report['numa_nodes']} NUMA node(s))"
    )
    print(f"  shared memory {shm.get('path')}: {_gib(shm.get('free_nbytes'))} free of {_gib(shm.get('total_nbytes'))}")
    print("  accelerators:")
    if not report["accelerators"]:
        print("    none")
    for name, entry in report["accelerators"].items():
        if "error" in entry:
            print(f"    {name}: {entry['error']}")
            continue
        visible = "all" if entry["visible"] is None else ",".join(entry["visible"]) or "none"
        print(f"    {name} (Ray resource {entry['resource']}, {'/'.join(entry['visibility_env'])}={visible})")
        for device in entry.get("devices", []):
            print(
                f"      #{device['index']} {device['uuid']} pci {device['pci_bus_id']}"
                f"{'' if device['visible'] else ' (not visible)'}"
            )
        for link in entry.get("p2p", []):
            print(f"      P2P {link['a']} <-> {link['b']}: {'yes' if link['p2p'] else 'no'}")
        if entry.get("reason"):
            print(f"      {entry['reason']}")
    nics = report["rdma_nics"]
    print(
        f"  RDMA NICs: {', '.join(n['name'] for n in nics) if nics else 'none (/sys/class/infiniband empty)'}; "
        f"GPUDirect RDMA: {'yes' if report['gpudirect_rdma'] else 'no'}"
    )
    print("  libraries: " + ", ".join(f"{k} {v}" for k, v in report["transport_libraries"].items()))
    print("  transports: " + ", ".join(f"{k} ({v})" for k, v in report["transports"].items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tensorwire", description="tensorwire tools")
    commands = parser.add_subparsers(dest="command", required=True)
    topo = commands.add_parser("topo", help="accelerators, links, NICs and transports of this node or a Ray cluster")
    topo.add_argument("--json", action="store_true", help="print JSON")
    topo.add_argument("--address", default="", help="a Ray cluster address: report every node of it")
    args = parser.parse_args(argv)
    if args.command == "topo":
        reports = _cluster_reports(args.address) if args.address else [_node_report()]
        if args.json:
            json.dump(reports, sys.stdout, indent=2, default=str)
            print()
        else:
            for report in reports:
                _print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
