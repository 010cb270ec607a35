"""The benchmark run: scenarios, baselines in the same run, the table, JSON and plot.

Scenarios (``--scenarios``, all by default):

* ``p2p-processes``: this process puts a value; a peer process on this node, and one that
  claims another node (``TENSORWIRE_NODE_ID``), fetch it: automatic choice and every usable
  transport forced. Baselines: bare torch.distributed gloo and bare ucxx between the same two
  processes (ask, then send; as a fetch does), bare NIXL (the peer READs a buffer this process
  registered; with nixl installed), and single-thread memcpy (the one-node bound).
* ``many-tensors``: the largest size as 1, 16, 256 and 1,024 tensors; vs memcpy tensor by tensor.
* ``concurrent``: ``--peers`` same-node processes fetch the largest value at once; aggregate GB/s.
* ``nixl-compare``: tensorwire's transports that read host memory across nodes (by capabilities:
  nixl, ucx, gloo, host) against a bare NIXL program between the same two processes, on one
  node and across claimed nodes, the same object again and a new object each round, at every
  size and as 1,024 tensors, interleaved (:mod:`tensorwire.bench.nixl_compare`).
* ``p2p-actors``: Ray actors: a ``@tw.method`` result and a ``@ray.method(tensor_transport=
  "tensorwire")`` result passed to another actor, vs Ray's object store (default, and with
  ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1``) and Ray's direct transport (gloo, nixl); every size,
  and the largest size of at least 1 MiB again as a 1,024-tensor state dict; the consumer
  copies the value into its own buffers in every case.
* ``one-to-n``: one actor's state into ``--peers`` actors: ``tw.WeightSync`` vs the object store
  (one put, N gets) vs torch.distributed gloo broadcast.
* ``sharded-sync``: a ``--max-bytes`` model from 2 trainer halves into 2 replicas x TP 2
  (:mod:`tensorwire.bench.sharded`): the plan vs gather-then-push vs the object store.

Process scenarios run first (standalone agents); the Ray scenarios then start a local Ray.

What is interleaved, exactly: the Ray scenarios interleave their methods round by round
(``bench/actors.py``). The process scenarios do not: per size, memcpy runs its whole loop in
this process, then each tensorwire method runs its whole loop in a peer, one after the other;
the bare gloo and ucxx baselines run after all sizes, between this process and the "other
node" peer (the same process pair as the "other node" rows). Their rows are therefore exposed
to load that changes between loops; compare them with that in mind, or rerun.

What ``--check`` checks: every timed iteration of every method. Receive buffers are zeroed
before each (outside the timing); the Ray scenarios and memcpy also change the data from one
round to the next. A process-scenario fetch reads one put value for all its rounds (a new put
per round would time exports, not fetches), so there zeroing is what makes a round that
writes nothing fail.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from tensorwire.bench.options import SCENARIOS, Options
from tensorwire.bench.processes import MANY_TENSORS, process_scenarios
from tensorwire.bench.schema import Fit, Row, document, make_row, validate
from tensorwire.bench.stats import fit_latency_bandwidth
from tensorwire.bench.table import format_table, plot
from tensorwire.progress import ProgressBar

__all__ = ["SCENARIOS", "Options", "format_table", "make_row", "run", "write_outputs"]


def _ray_scenarios(options: Options, progress: ProgressBar, notes: list[str]) -> list[Row]:
    from tensorwire.bench import actors

    return actors.run(options, progress, notes)


# ---------------------------------------------------------------------- results


def _compare(rows: list[Row]) -> None:
    """Fill ``vs_best_baseline`` and ``vs_memcpy`` of tensorwire rows."""
    groups: dict[tuple[str, int, int, int], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.scenario, row.nbytes, row.tensors, row.peers), []).append(row)
    for group in groups.values():
        alternatives = [r.p50_us for r in group if r.baseline and not r.method.startswith("memcpy")]
        memcpy = [r.p50_us for r in group if r.method.startswith("memcpy")]
        for row in group:
            if row.baseline:
                continue
            if alternatives and row.vs_best_baseline is None:  # a scenario may have set its own comparison
                row.vs_best_baseline = min(alternatives) / row.p50_us
            if memcpy:
                row.vs_memcpy = memcpy[0] / row.p50_us


def _fits(rows: list[Row]) -> list[Fit]:
    by_method: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        if row.scenario in ("p2p-processes", "p2p-actors", "one-to-n") and row.tensors == 1:
            by_method.setdefault((row.scenario, row.method), []).append(row)
    fits = []
    for (scenario, method), group in by_method.items():
        if len({r.nbytes for r in group}) < 2:
            continue
        latency, bandwidth = fit_latency_bandwidth([r.nbytes for r in group], [r.p50_us / 1e6 for r in group])
        fits.append(Fit(scenario, method, max(latency, 0.0) * 1e6, bandwidth, sorted(r.nbytes for r in group)))
    return fits


def _steps(options: Options) -> int:
    """Progress steps of the selected scenarios (forced transports and sharded-sync's methods
    are added once known)."""
    per_size = {"p2p-processes": 3, "p2p-actors": 6, "one-to-n": 3}  # memcpy + 2 autos; 6 methods; 3 methods
    steps = sum(per_size.get(s, 0) for s in options.scenarios) * len(options.sizes)
    if "p2p-actors" in options.scenarios and any(n >= 1 << 20 for n in options.sizes):
        steps += per_size["p2p-actors"]  # the state-dict case
    steps += 3 * ("p2p-processes" in options.scenarios)  # bare gloo, bare ucxx, bare NIXL
    steps += len(MANY_TENSORS) * ("many-tensors" in options.scenarios) + ("concurrent" in options.scenarios)
    steps += 2 * ("nixl-compare" in options.scenarios)  # one node, two nodes
    return steps


def run(options: Options, progress_enabled: bool = False) -> tuple[list[Row], list[Fit], list[str]]:
    """Every requested scenario; (rows, latency/bandwidth fits, notes on what was skipped)."""
    notes: list[str] = []
    progress = ProgressBar(_steps(options), desc="bench", unit="step", enabled=progress_enabled)
    rows: list[Row] = []
    try:
        if set(options.scenarios) & {"p2p-processes", "many-tensors", "concurrent"}:
            rows += process_scenarios(options, progress, notes)
        if "nixl-compare" in options.scenarios:
            from tensorwire.bench import nixl_compare

            rows += nixl_compare.bench_rows(options, progress, notes)
        if set(options.scenarios) & {"p2p-actors", "one-to-n"}:
            rows += _ray_scenarios(options, progress, notes)
        if "sharded-sync" in options.scenarios:
            from tensorwire.bench import sharded

            rows += sharded.run(options, progress, notes)
    finally:
        progress.close()
    order = {name: i for i, name in enumerate(SCENARIOS)}
    rows.sort(key=lambda r: (order.get(r.scenario, len(order)), r.tensors, r.nbytes, r.peers))  # stable: methods stay
    _compare(rows)
    return rows, _fits(rows), notes


# ---------------------------------------------------------------------- output


def write_outputs(rows: list[Row], fits: list[Fit], argv: list[str], json_path: str, plot_path: str) -> None:
    if json_path:
        doc = document(argv, rows, fits)
        problems = validate(doc)
        if problems:
            raise RuntimeError(f"bench document fails its own schema: {problems}")
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
    if plot_path:
        plot(rows, plot_path)


def main(
    options: Options, argv: list[str], json_path: str = "", plot_path: str = "", echo: Callable[[str], None] = print
) -> int:
    rows, fits, notes = run(options, progress_enabled=options.progress)
    echo(format_table(rows, fits))
    for note in notes:
        echo(f"skipped {note}")
    write_outputs(rows, fits, argv, json_path, plot_path)
    wrong = sum(max(r.wrong, 0) for r in rows)
    if wrong:
        echo(f"{wrong} transfer(s) delivered wrong data")
    return 1 if wrong else 0
