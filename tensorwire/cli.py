"""``tensorwire`` command line: ``tensorwire topo [--json] [--address ADDR]``, ``tensorwire doctor``,
``tensorwire bench``, ``tensorwire plan`` (:mod:`tensorwire.plan_command`), ``tensorwire --version``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tensorwire import plan_command

__all__ = ["main"]


def _node_report() -> dict[str, Any]:
    """This node's topology plus the transports its agent can use (runs on any node)."""
    from tensorwire.runtime.agent import agent as runtime_agent
    from tensorwire.transport import registry
    from tensorwire.transport.hw.topology import describe_node

    agent = runtime_agent()  # first: under Ray its start-up takes the node id from Ray
    report = describe_node()
    unusable = agent.unusable_transports()
    report["transport_libraries"] = registry.library_report()
    report["transports"] = {name: unusable.get(name, "usable") for name in registry.registered_transports()}
    return report


def _cluster_reports(address: str) -> list[dict[str, Any]]:
    """One report per alive Ray node, each gathered by a short-lived task pinned to that node."""
    import tensorwire as tw
    from tensorwire.runtime.ray import calls

    tw.init(address=address)
    return calls.on_every_node(_node_report, timeout_s=120)


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
        variable = entry.get("visible_from") or "/".join(entry["visibility_env"])
        fraction = "fractional resources: " + ("yes" if entry.get("fractional") else "no, whole devices only")
        print(f"    {name} (Ray resource {entry['resource']}, {variable}={visible}; {fraction})")
        if entry.get("id_form"):
            print(f"      device ids: {entry['id_form']}")
        for part in entry.get("partitions", []):
            pes = ",".join(str(pe) for pe in part["pes"])
            print(f"      npu {part['device']}: {'PEs ' + pes if pes else 'whole device'}")
        for device in entry.get("devices", []):
            print(
                f"      #{device['index']} {device['uuid']} pci {device['pci_bus_id']}"
                f"{'' if device['visible'] else ' (not visible)'}"
            )
        for link in entry.get("p2p", []):
            print(f"      #{link['a']} <-> #{link['b']}: {link.get('link') or ('P2P' if link['p2p'] else 'no P2P')}")
        for uuid, near in entry.get("nic_affinity", {}).items():
            if near:
                print(f"      {uuid} near NICs: {', '.join(near)}")
        if entry.get("reason"):
            print(f"      {entry['reason']}")
    nics = report["rdma_nics"]
    print(
        f"  RDMA NICs: {', '.join(n['name'] for n in nics) if nics else 'none (/sys/class/infiniband empty)'}; "
        f"GPUDirect RDMA: {'yes' if report['gpudirect_rdma'] else 'no'}"
    )
    print("  libraries: " + ", ".join(f"{k} {v}" for k, v in report["transport_libraries"].items()))
    print("  transports: " + ", ".join(f"{k} ({v})" for k, v in report["transports"].items()))


def _doctor(progress: bool = False) -> list[tuple[str, str, str]]:
    """End-to-end checks with real transfers between this process and local peer processes
    (``progress``: a bar on stderr, one step per transport)."""
    import torch

    from tensorwire.peers import digest_of_fetch, peers
    from tensorwire.progress import ProgressBar
    from tensorwire.runtime.agent import agent as runtime_agent
    from tensorwire.transport import registry
    from tensorwire.transport.hw.topology import describe_node

    results: list[tuple[str, str, str]] = []
    node = describe_node()
    nvidia = node["accelerators"].get("nvidia", {})
    if nvidia.get("devices"):
        results.append(("NVML", "ok", f"{len(nvidia['devices'])} NVIDIA GPU(s)"))
    else:
        results.append(("NVML", "warn", str(nvidia.get("reason") or "no NVIDIA GPU")))
    if not node["rdma_nics"]:
        results.append(("RDMA", "warn", "no InfiniBand/RoCE NIC: cross-node traffic uses TCP"))
    agent = runtime_agent()
    large = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8)
    small = large[:1024].clone()  # inline carries only small values
    names = registry.registered_transports()
    with (
        ProgressBar(len(names), desc="doctor", unit="transport", enabled=progress) as bar,
        peers(digest_of_fetch, agent.peer.node_id, "doctor") as connections,
    ):
        for name in names:
            bar.step(name, 0)  # names the transport being checked
            results.extend(_check_transport(name, agent, connections, large, small))
            bar.step(name)
    for reports in agent.diagnose().values():  # each usable transport on its library and hardware
        results.extend((d.check, d.health.value, d.detail) for d in reports)
    return results


def _check_transport(
    name: str, agent: Any, connections: dict[str, Any], large: Any, small: Any
) -> list[tuple[str, str, str]]:
    """``doctor`` for one transport: a real transfer of ``large`` (``small`` for inline) into
    each peer process it can serve, checked by digest."""
    import hashlib

    import tensorwire as tw
    from tensorwire.peers import OTHER_NODE, ask, consumer_device
    from tensorwire.transport import registry
    from tensorwire.transport.contract import MemoryKind

    results: list[tuple[str, str, str]] = []
    digests = {id(v): hashlib.sha256(v.numpy().tobytes()).hexdigest() for v in (large, small)}
    caps = registry.get_transport_class(name).capabilities
    if name in agent.unusable_transports():
        # Missing hardware or an optional library is a warning; a broken plug-in fails.
        reason = agent.unusable_transports()[name]
        results.append((f"transport {name}", "fail" if "failed to load" in reason else "warn", reason))
        return results
    value = small if caps.carries_value else large
    expected = digests[id(value)]
    if MemoryKind.HOST not in caps.memory:  # a GPU-only transport moves a GPU copy
        value = value.cuda(0)
    device, missing = consumer_device(caps)  # NCCL: the peer receives on another GPU
    if missing:
        results.append((f"transport {name}", "warn", missing))
        return results
    size = f"{value.numel() // 1024} KiB"
    if caps.same_process:
        got = tw.get(tw.put(value), transport=name)
        ok = hashlib.sha256(got.cpu().numpy().tobytes()).hexdigest() == expected
        results.append((f"transport {name}", "ok" if ok else "fail", f"same process, {size}"))
        return results
    for where, conn in connections.items():
        if where == OTHER_NODE and not caps.cross_node:
            continue
        status, detail = ask(conn, (tw.put(value), name, device), timeout_s=60)
        if status in ("timeout", "died"):
            status, detail = "fail", f"{where}: {detail}"
        elif status == "ok" and detail != expected:
            status, detail = "fail", "data arrived corrupted"
        results.append((f"transport {name}", status, f"{where}, {size}" if status == "ok" else detail))
    return results


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    if args.calibrate:
        return _calibrate(args)
    from tensorwire.bench.runner import SCENARIOS, Options, main
    from tensorwire.bench.stats import sizes

    scenarios = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    unknown = [s for s in scenarios if s not in SCENARIOS]
    transports = [t.strip() for t in args.transports.split(",") if t.strip()] if args.transports else None
    problems = []
    if unknown:
        problems.append(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    if args.iters < 1 or args.warmup_iters < 0 or args.peers < 1:
        problems.append("-n must be at least 1, -w at least 0 and --peers at least 1")
    try:
        series = sizes(args.min_bytes, args.max_bytes or 16 << 20, args.factor)
    except ValueError as e:
        problems.append(str(e))
        series = []
    if len(series) > 64:
        problems.append(f"{len(series)} sizes: raise -f or narrow -b/-e")
    if transports is not None:
        from tensorwire.transport import registry

        for name in transports:
            if name != "auto":
                try:
                    registry.get_transport_class(name)
                except Exception as e:  # noqa: BLE001 - reported as a usage error
                    problems.append(str(e))
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            problems.append("--plot needs matplotlib: pip install 'tensorwire[plot]'")
    if problems:
        for problem in problems:
            print(f"tensorwire bench: {problem}", file=sys.stderr)
        return 2
    options = Options(
        min_bytes=args.min_bytes,
        max_bytes=series[-1],
        factor=args.factor,
        iterations=args.iters,
        warmups=args.warmup_iters,
        transports=transports,
        peers=args.peers,
        check=args.check,
        scenarios=scenarios,
        progress=sys.stderr.isatty() if args.progress is None else args.progress,
        sizes=series,
        timeline=timeline_path(args.plot) if args.plot else "",
    )
    return main(options, ["tensorwire", *argv], json_path=args.json or "", plot_path=args.plot or "")


def timeline_path(plot: str) -> str:
    """Where ``--plot PATH`` puts the sharded-sync timeline: next to PATH, ``-sharded-timeline`` added."""
    stem, dot, suffix = plot.rpartition(".")
    return f"{stem}-sharded-timeline.{suffix}" if dot and "/" not in suffix else f"{plot}-sharded-timeline.png"


def _calibrate(args: argparse.Namespace) -> int:
    max_bytes = args.max_bytes or 64 << 20
    iters = args.iters if args.iters_given else 5
    if max_bytes < 1 << 20 or iters < 1:
        print("tensorwire bench: --max-bytes must be at least 1 MiB and --iters at least 1", file=sys.stderr)
        return 2
    from tensorwire.calibrate import calibrate
    from tensorwire.transport.hw.calibration import costs_path, save_costs

    print(f"calibrating with {max_bytes} B values, {iters} repeats (small values: just past the inline limit):")
    costs, notes = calibrate(max_bytes, iters)
    for note in notes:
        print(f"  skipped {note}")
    if not costs:
        print("nothing measured; no table written", file=sys.stderr)
        return 1
    path = save_costs(costs, args.output or costs_path())
    print(f"wrote {path}: agents started from now on rank transports by it")
    return 0


class _Given(argparse.Action):
    """Store the value and remember that it was given (defaults differ between modes)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def _add_bench_arguments(bench: argparse.ArgumentParser) -> None:
    from tensorwire.bench.runner import SCENARIOS
    from tensorwire.bench.stats import parse_size

    bench.add_argument("-b", "--min-bytes", type=parse_size, default=4 << 10, help="smallest size (default 4K)")
    bench.add_argument(
        "-e",
        "--max-bytes",
        type=parse_size,
        default=None,
        help="largest size (default 16M; with --calibrate the bandwidth size, default 64M)",
    )
    bench.add_argument("-f", "--factor", type=float, default=16.0, help="size multiplication factor (default 16)")
    bench.add_argument(
        "-n",
        "--iters",
        type=int,
        default=20,
        action=_Given,
        help="timed iterations per size (default 20; with --calibrate repeats, default 5)",
    )
    bench.add_argument("-w", "--warmup-iters", type=int, default=3, help="untimed iterations first (default 3)")
    bench.add_argument("--transports", default="", help="comma-separated transports to force (default: every usable)")
    bench.add_argument("--peers", type=int, default=2, help="receivers in concurrent and one-to-n (default 2)")
    bench.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, from: {', '.join(SCENARIOS)} (default all)"
    )
    bench.add_argument("--check", action="store_true", help="verify every byte that arrived (#wrong column)")
    bench.add_argument("--json", default="", help="write the results here (schema tensorwire-bench v1)")
    bench.add_argument("--plot", default="", help="write a PNG of GB/s against size here (needs matplotlib)")
    bench.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    bench.add_argument(
        "--calibrate", action="store_true", help="measure every transport and write this machine's cost table"
    )
    bench.add_argument("--output", default="", help="--calibrate: where to write the table (default: this machine's)")
    bench.set_defaults(iters_given=False)


def _version() -> str:
    """The installed distribution's version (package metadata), else the source tree's."""
    from importlib import metadata

    try:
        return metadata.version("tensorwire")
    except metadata.PackageNotFoundError:
        import tensorwire

        return f"{tensorwire.__version__} (not installed)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tensorwire", description="tensorwire tools")
    parser.add_argument("--version", action="version", version=f"tensorwire {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    topo = commands.add_parser("topo", help="accelerators, links, NICs and transports of this node or a Ray cluster")
    topo.add_argument("--json", action="store_true", help="print JSON")
    topo.add_argument("--address", default="", help="a Ray cluster address: report every node of it")
    doctor = commands.add_parser("doctor", help="check every transport with a real transfer; say what to fix")
    doctor.add_argument("--json", action="store_true", help="print JSON")
    doctor.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    bench = commands.add_parser(
        "bench",
        help="transports against the alternatives, same run (nccl-tests style flags); --calibrate for the selector",
    )
    _add_bench_arguments(bench)
    plan = commands.add_parser("plan", help="plan a push from layouts alone and model it on a cluster's links")
    plan_command.add_arguments(plan)
    args = parser.parse_args(argv)
    if args.command == "plan":
        return plan_command.run(args)
    if args.command == "bench":
        return _bench(args, list(argv if argv is not None else sys.argv[1:])[1:])
    if args.command == "doctor":
        results = _doctor(sys.stderr.isatty() if args.progress is None else args.progress)
        if args.json:
            json.dump([{"check": c, "status": s, "detail": d} for c, s, d in results], sys.stdout, indent=2)
            print()
        else:
            for check, status, detail in results:
                print(f"{status.upper():5} {check:20} {detail}")
        return 1 if any(status == "fail" for _, status, _ in results) else 0
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
