"""``tensorwire plan``: a push planned from layouts alone (no actors, no tensors) and modelled on
a cluster's links (:mod:`tensorwire.collectives.weight_sync.model`).

The input is a built-in template (``--template``: ``kimi-k2``, ``qwen3-235b``, ``dense-70b``)
or a JSON/YAML file (``--config``) that names one and changes what it says::

    template: kimi-k2
    trainers: {ranks: 256, shard: 8, ep: 128, dtype: bfloat16}
    receivers: {replicas: 2, ranks_per_replica: 64, tp: 8, dtype: bfloat16}
    cluster: {gpus_per_node: 8, nvlink_gbps: 450, nics_per_node: 8, nic_gbps: 50, latency_us: 10}
    bucket_mib: 64

It prints the plan's totals, the modelled push, the bound it is compared to (the busiest link's
bytes at its bandwidth) and the busiest links, with the time and memory planning took;
``--json`` for tools, ``--plot PATH`` for a picture of the links' use over time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import resource
import sys
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["add_arguments", "run"]

_TRAINER_KEYS = {"ranks": "trainer_ranks", "shard": "trainer_shard", "ep": "trainer_ep", "dtype": "dtype"}
_RECEIVER_KEYS = {
    "replicas": "replicas",
    "ranks_per_replica": "ranks_per_replica",
    "tp": "tp",
    "dtype": "receiver_dtype",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tensorwire.collectives.weight_sync.model.templates import TEMPLATES

    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--template", choices=sorted(TEMPLATES), help="a built-in model and its layouts")
    source.add_argument("--config", help="a JSON or YAML file: a template and what to change (see the docs)")
    parser.add_argument("--bucket-mib", type=int, default=None, help="bucket size (default 64 MiB, or the config's)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--plot", help="write a PNG of the links' use over time here (needs matplotlib)")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bars on stderr (default: when stderr is a terminal)",
    )


def run(args: argparse.Namespace) -> int:
    config = {"template": args.template} if args.template else load_config(args.config)
    if args.bucket_mib is not None:
        config["bucket_mib"] = args.bucket_mib
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    result, modelled = model(config, progress=progress)
    if args.plot:
        from tensorwire.collectives.weight_sync.model.picture import plot_links

        plot_links(modelled, args.plot, title=f"{result['template']}: modelled push, links' use")
        result["plot"] = args.plot
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print(_text(result))
    return 0


def load_config(path: str) -> dict[str, Any]:
    """A config file (JSON, or YAML when the name ends in .yaml/.yml).

    Raises:
        ValueError: Not a mapping.
    """
    with open(path) as f:
        text = f.read()
    if path.endswith((".yaml", ".yml")):
        import yaml

        config = yaml.safe_load(text)
    else:
        config = json.loads(text)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a config is a mapping (template, trainers, receivers, cluster, bucket_mib)")
    return config


def model(config: Mapping[str, Any], *, progress: bool = False) -> tuple[dict[str, Any], Any]:
    """Plan and model the push ``config`` describes; (its numbers as JSON-able values, the
    :class:`~tensorwire.collectives.weight_sync.model.simulate.Modelled` push)."""
    from tensorwire.collectives.weight_sync.model.cluster import Cluster, Placement
    from tensorwire.collectives.weight_sync.model.flows import flows_of
    from tensorwire.collectives.weight_sync.model.simulate import simulate
    from tensorwire.collectives.weight_sync.planning.plan import plan_sync

    template = template_of(config)
    cluster = Cluster.from_dict(config.get("cluster", {}))
    bucket_bytes = int(config.get("bucket_mib", 64)) << 20
    steps: dict[str, float] = {}
    start = time.perf_counter()
    trainers, receivers = template.trainer_layouts(), template.receiver_layouts()
    steps["layouts_s"] = time.perf_counter() - start
    plan = plan_sync(trainers, receivers)
    steps["plan_s"] = time.perf_counter() - start - steps["layouts_s"]
    placement = Placement(cluster, len(trainers), len(receivers))
    flows = flows_of(plan, placement, bucket_bytes, progress=progress)
    steps["flows_s"] = time.perf_counter() - start - steps["layouts_s"] - steps["plan_s"]
    modelled = simulate(flows, placement, progress=progress)
    steps["model_s"] = time.perf_counter() - start - sum(steps.values())
    shapes = template.shapes()
    result = {
        "template": template.name,
        "about": template.about,
        "tensors": len(shapes),
        "params": sum(math.prod(shape) for shape, _kind in shapes.values()),
        "trainers": len(trainers),
        "receivers": len(receivers),
        "nodes": placement.nodes,
        "cluster": dataclasses.asdict(cluster),
        "bucket_bytes": bucket_bytes,
        "push_nbytes": plan.nbytes,
        "receiver_nbytes_max": max(plan.receiver_nbytes().values()),
        "transfers": flows.transfers,
        "pairs": len(plan.pair_nbytes()),
        "bucket_flows": flows.count,
        "modelled_s": modelled.seconds,
        "bound_s": modelled.bound_s,
        "over_bound": modelled.over_bound,
        "busiest": [{"link": str(link), "nbytes": n, "seconds": s} for link, n, s in modelled.busiest],
        **steps,
        "planning_s": sum(steps.values()),
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    return result, modelled


def template_of(config: Mapping[str, Any]) -> Any:
    """The config's template with its ``trainers`` and ``receivers`` changes.

    Raises:
        ValueError: No or an unknown template, or an unknown key (named, with the keys there are).
    """
    from tensorwire.collectives.weight_sync.model.templates import TEMPLATES

    unknown = sorted(set(config) - {"template", "trainers", "receivers", "cluster", "bucket_mib"})
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}")
    name = config.get("template")
    if name not in TEMPLATES:
        raise ValueError(f"template {name!r}: one of {sorted(TEMPLATES)}")
    changes = {}
    for section, keys in (("trainers", _TRAINER_KEYS), ("receivers", _RECEIVER_KEYS)):
        given = dict(config.get(section, {}))
        wrong = sorted(set(given) - set(keys))
        if wrong:
            raise ValueError(f"{section}: unknown key(s) {wrong}; the keys are {sorted(keys)}")
        changes |= {keys[k]: v for k, v in given.items()}
    return dataclasses.replace(TEMPLATES[name], **changes)


def _text(result: Mapping[str, Any]) -> str:
    gib = 2**30
    lines = [
        f"{result['template']}: {result['about']}",
        f"  {result['tensors']:,} tensors, {result['params'] / 1e9:,.1f} B parameters; "
        f"{result['trainers']} trainer ranks -> {result['receivers']} receiver ranks on {result['nodes']} nodes",
        f"  plan: {result['push_nbytes'] / gib:,.1f} GiB per push in {result['transfers']:,} transfers over "
        f"{result['pairs']:,} pairs; busiest receiver {result['receiver_nbytes_max'] / gib:.2f} GiB; "
        f"{result['bucket_flows']:,} bucket flows of at most {result['bucket_bytes'] >> 20} MiB",
        f"  modelled push {result['modelled_s']:.3f} s; bound {result['bound_s']:.3f} s (the busiest link's bytes "
        f"at its bandwidth): {result['over_bound']:.2f}x the bound",
        "  busiest links:",
    ]
    lines += [f"    {b['link']:28} {b['nbytes'] / gib:8.2f} GiB  {b['seconds']:.3f} s" for b in result["busiest"][:5]]
    lines.append(
        f"  planning took {result['planning_s']:.1f} s (layouts {result['layouts_s']:.1f}, "
        f"plan {result['plan_s']:.1f}, flows {result['flows_s']:.1f}, model {result['model_s']:.1f}); "
        f"peak memory {result['maxrss_mib']:.0f} MiB"
    )
    return "\n".join(lines)
