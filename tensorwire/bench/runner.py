"""The benchmark run: scenarios, baselines in the same run, the table, JSON and plot.

Scenarios (``--scenarios``, all by default):

* ``p2p-processes``: this process puts a value; a peer process on this node, and one that
  claims another node (``TENSORWIRE_NODE_ID``), fetch it: automatic choice and every usable
  transport forced. Baselines: bare torch.distributed gloo and bare ucxx between the same two
  processes (ask, then send; as a fetch does), bare NIXL (the peer READs a buffer this process
  registered; with nixl installed), and single-thread memcpy (the one-node bound).
* ``many-tensors``: the largest size as 1, 16, 256 and 1,024 tensors; vs memcpy tensor by tensor.
* ``concurrent``: ``--peers`` same-node processes fetch the largest value at once; aggregate GB/s.
* ``nixl-compare``: tensorwire nixl, ucx and host against a bare NIXL program between the same two
  processes, on one node and across claimed nodes, the same object again and a new object each
  round, at every size and as 1,024 tensors, interleaved (:mod:`tensorwire.bench.nixl_compare`).
* ``p2p-actors``: Ray actors: a ``@tw.method`` result passed to another actor, vs Ray's object
  store (default, and with ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1``) and Ray's direct transport
  (gloo); the consumer copies the value into its own buffers in every case.
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

import contextlib
import gc
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tensorwire.bench import ops
from tensorwire.bench.schema import Fit, Row, document, validate
from tensorwire.bench.stats import bus_bandwidth, fit_latency_bandwidth, gbps, summarize
from tensorwire.bench.table import format_table, plot
from tensorwire.progress import ProgressBar

__all__ = ["SCENARIOS", "Options", "format_table", "make_row", "run", "write_outputs"]

SCENARIOS = ("p2p-processes", "many-tensors", "concurrent", "nixl-compare", "p2p-actors", "one-to-n", "sharded-sync")
MANY_TENSORS = (1, 16, 256, 1024)
_PEER_TIMEOUT_S = 600.0


@dataclass
class Options:
    """What to measure (see ``tensorwire bench --help``)."""

    min_bytes: int = 4 << 10
    max_bytes: int = 16 << 20
    factor: float = 16.0
    iterations: int = 20
    warmups: int = 3
    transports: list[str] | None = None  # None: every usable one
    peers: int = 2
    check: bool = False
    scenarios: tuple[str, ...] = SCENARIOS
    progress: bool = False
    sizes: list[int] = field(default_factory=list)


def make_row(
    scenario: str,
    method: str,
    result: dict,
    *,
    baseline: bool,
    nbytes: int,
    tensors: int = 1,
    peers: int = 1,
    transport: str = "",
    reason: str = "",
    operation: str = "p2p",
    rate: float | None = None,
) -> Row:
    """A row from a timed loop's result (``times`` in seconds, ``wrong``)."""
    summary = summarize(result["times"])
    algbw = rate if rate is not None else gbps(nbytes, summary.p50)
    return Row(
        scenario=scenario, method=method, baseline=baseline, transport=transport, reason=reason, nbytes=nbytes,
        tensors=tensors, peers=peers, iterations=summary.count, p50_us=summary.p50 * 1e6, p99_us=summary.p99 * 1e6,
        mean_us=summary.mean * 1e6, gbps=algbw, busbw_gbps=bus_bandwidth(operation, algbw, peers + 1),
        wrong=int(result.get("wrong", -1)),
    )  # fmt: skip


def _ask(conn: Any, *message: Any) -> Any:
    from tensorwire.peers import ask

    status, result = ask(conn, message, timeout_s=_PEER_TIMEOUT_S)
    if status != "ok":
        raise RuntimeError(f"benchmark peer: {message[0]} failed: {result}")
    return result


# ---------------------------------------------------------------------- process scenarios


def _transports_to_run(options: Options, notes: list[str]) -> list[tuple[str, bool, str | None]]:
    """(transport, same node, the consumer's device) to force, after skipping what cannot
    run here."""
    import torch

    from tensorwire.peers import consumer_device
    from tensorwire.runtime.ray_env import agent as runtime_agent
    from tensorwire.transport import registry
    from tensorwire.transport.contract import MemoryKind

    unusable = runtime_agent().unusable_transports()
    chosen = options.transports if options.transports is not None else registry.registered_transports()
    result = []
    for name in chosen:
        if name == "auto":
            continue
        caps = registry.get_transport_class(name).capabilities  # unknown names: "did you mean"
        device, missing = consumer_device(caps)
        if name == "local":
            notes.append("local: same process only, nothing to measure between processes")
        elif name in unusable:
            notes.append(f"{name}: not usable here ({unusable[name]})")
        elif MemoryKind.HOST not in caps.memory and not torch.cuda.is_available():
            notes.append(f"{name}: needs a GPU; this machine has none")
        elif missing:
            notes.append(f"{name}: {missing}")
        else:
            result.append((name, not caps.cross_node, device))
    return result


def _bare_pair(kind: str, conn: Any, sizes: list[int], options: Options, notes: list[str]) -> dict[int, dict]:
    """Bare ``kind`` ("gloo" or "ucxx") from this process to the peer ``conn``, per size."""
    results: dict[int, dict] = {}
    count = options.warmups + options.iterations
    try:
        if kind == "ucxx":
            try:
                import ucxx  # noqa: F401
            except ImportError:
                notes.append("bare ucxx: ucxx is not installed (pip install tensorwire[ucx])")
                return results
            peer_address = _ask(conn, "ucx_start")
            _ask(conn, "ucx_connect", ops.ucx_start())
            ops.ucx_connect(peer_address)
            serve, fetch = ops.ucx_serve, "ucx_fetch"
        else:
            port = ops.gloo_join("127.0.0.1", 0, 0)
            _ask(conn, "gloo_join", "127.0.0.1", port, 1)
            ops.gloo_wait_ready()
            serve, fetch = ops.gloo_serve, "gloo_fetch"
        for nbytes in sizes:
            server = threading.Thread(target=serve, args=(nbytes, count), daemon=True)
            server.start()
            results[nbytes] = _ask(conn, fetch, nbytes, options.iterations, options.warmups, options.check)
            server.join(60)
    finally:
        if kind == "ucxx":
            with contextlib.suppress(Exception):
                _ask(conn, "ucx_stop")
            ops.ucx_stop()
        else:
            with contextlib.suppress(Exception):
                _ask(conn, "gloo_stop")
            ops.gloo_stop()
    return results


def _bare_nixl(conn: Any, sizes: list[int], options: Options, notes: list[str]) -> dict[int, dict]:
    """Bare NIXL: the peer ``conn`` READs a buffer this process registered, per size."""
    from tensorwire.errors import TransportUnavailableError
    from tensorwire.transport.backends.nixl.engine import nixl_api

    try:
        nixl_api()
    except TransportUnavailableError as e:
        notes.append(f"bare NIXL: {e}")
        return {}
    results: dict[int, dict] = {}
    try:
        ops.nixl_start("producer")
        _ask(conn, "nixl_start", "consumer")
        for nbytes in sizes:
            metadata, rows = ops.nixl_offer(nbytes)
            args = (metadata, rows, nbytes, options.iterations, options.warmups, options.check)
            results[nbytes] = _ask(conn, "nixl_fetch", *args)
    finally:
        with contextlib.suppress(Exception):
            _ask(conn, "nixl_stop")
        ops.nixl_stop()
    return results


def _value(nbytes: int, tensors: int, cuda: bool) -> Any:
    value = ops.make_value(nbytes, tensors)
    if cuda:
        return value.cuda() if not isinstance(value, list) else [t.cuda() for t in value]
    return value


def _process_scenarios(options: Options, progress: ProgressBar, notes: list[str]) -> list[Row]:
    import tensorwire as tw
    from tensorwire.peers import spawn
    from tensorwire.runtime.ray_env import agent as runtime_agent
    from tensorwire.transport import registry
    from tensorwire.transport.contract import MemoryKind

    agent = runtime_agent()
    sizes, rows = options.sizes, []
    forced = _transports_to_run(options, notes)
    if "p2p-processes" in options.scenarios:
        progress.total += len(sizes) * len(forced)
    envs = {f"same{i}": {"OMP_NUM_THREADS": "1"} for i in range(max(1, options.peers))}
    envs["other"] = {"OMP_NUM_THREADS": "1", "TENSORWIRE_NODE_ID": f"{agent.peer.node_id}/bench"}
    with spawn(ops.dispatch, envs) as peers:
        same, other = peers["same0"], peers["other"]

        def fetch(conn: Any, ref: Any, transport: str, nbytes: int, tensors: int, *, device: str | None = None) -> dict:
            return _ask(conn, "tw_fetch", ref, transport, device, nbytes, tensors, options.iterations,
                        options.warmups, options.check)  # fmt: skip

        if "p2p-processes" in options.scenarios:
            for nbytes in sizes:
                memcpy = ops.memcpy(nbytes, 1, options.iterations, options.warmups, options.check)
                rows.append(make_row("p2p-processes", "memcpy (one thread)", memcpy, baseline=True, nbytes=nbytes,
                                 reason="single-thread numpy copy in one process: the one-node bound"))  # fmt: skip
                progress.step(f"memcpy {nbytes}")
                host_ref = tw.put(_value(nbytes, 1, cuda=False))
                plans = [("tensorwire auto (same node)", same, "", host_ref, None),
                         ("tensorwire auto (other node)", other, "", host_ref, None)]  # fmt: skip
                cuda_ref = None
                for name, same_node, device in forced:
                    caps = registry.get_transport_class(name).capabilities
                    if caps.carries_value and nbytes > agent.config.inline_max_nbytes:
                        progress.total -= 1
                        continue
                    ref = host_ref
                    if MemoryKind.HOST not in caps.memory:
                        cuda_ref = cuda_ref or tw.put(_value(nbytes, 1, cuda=True))
                        ref = cuda_ref
                    where = "same node" if same_node else "other node"
                    plans.append((f"tensorwire {name} ({where})", same if same_node else other, name, ref, device))
                for method, conn, transport, ref, device in plans:
                    result = fetch(conn, ref, transport, nbytes, 1, device=device)
                    reason = result["reason"] if not transport else "forced"
                    rows.append(make_row("p2p-processes", method, result, baseline=False, nbytes=nbytes,
                                     transport=result["transport"], reason=reason))  # fmt: skip
                    progress.step(f"{method} {nbytes}")
                del host_ref, cuda_ref
            for kind in ("gloo", "ucxx"):
                label = "bare torch.distributed gloo" if kind == "gloo" else "bare ucxx"
                for nbytes, result in _bare_pair(kind, other, sizes, options, notes).items():
                    rows.append(make_row("p2p-processes", label, result, baseline=True, nbytes=nbytes, transport=kind,
                                     reason="ask, then send, on a connected pair"))  # fmt: skip
                progress.step(label)
            for nbytes, result in _bare_nixl(other, sizes, options, notes).items():
                rows.append(make_row("p2p-processes", "bare NIXL", result, baseline=True, nbytes=nbytes,
                                     transport="nixl", reason="one-sided READ of a registered buffer"))  # fmt: skip
            progress.step("bare NIXL")

        largest = sizes[-1]
        if "many-tensors" in options.scenarios:
            for tensors in MANY_TENSORS:
                ref = tw.put(_value(largest, tensors, cuda=False))
                for method, conn in (("tensorwire auto (same node)", same), ("tensorwire auto (other node)", other)):
                    result = fetch(conn, ref, "", largest, tensors)
                    rows.append(make_row("many-tensors", method, result, baseline=False, nbytes=largest,
                                         tensors=tensors, transport=result["transport"],
                                         reason=result["reason"]))  # fmt: skip
                del ref
                memcpy = ops.memcpy(largest, tensors, options.iterations, options.warmups, options.check)
                rows.append(make_row("many-tensors", "memcpy (one thread)", memcpy, baseline=True, nbytes=largest,
                                 tensors=tensors, reason="tensor by tensor, one process"))  # fmt: skip
                progress.step(f"many tensors x{tensors}")

        if "concurrent" in options.scenarios:
            ref = tw.put(_value(largest, 1, cuda=False))
            readers = [peers[f"same{i}"] for i in range(max(1, options.peers))]
            message = ("tw_fetch", ref, "", None, largest, 1, options.iterations, options.warmups, options.check)
            for conn in readers:
                conn.send(message)
            results = []
            for conn in readers:
                if not conn.poll(_PEER_TIMEOUT_S):
                    raise RuntimeError("benchmark peer: a concurrent fetch gave no answer")
                status, result = conn.recv()
                if status != "ok":
                    raise RuntimeError(f"benchmark peer: concurrent fetch failed: {result}")
                results.append(result)
            busy = max(sum(r["times"]) for r in results)  # the readers ran at once: the longest one's timed work
            merged = {"times": [t for r in results for t in r["times"]],
                      "wrong": sum(r["wrong"] for r in results) if options.check else -1}  # fmt: skip
            total = largest * options.iterations * len(readers)
            rows.append(make_row("concurrent", f"tensorwire auto x{len(readers)} readers", merged, baseline=False,
                             nbytes=largest, peers=len(readers), transport=results[0]["transport"],
                             reason=results[0]["reason"], operation="one_to_n",
                             rate=total / busy / 1e9 / len(readers)))  # fmt: skip
            del ref
            memcpy = ops.memcpy(largest, 1, options.iterations, options.warmups, options.check)
            rows.append(make_row("concurrent", "memcpy (one thread)", memcpy, baseline=True, nbytes=largest,
                             peers=len(readers), reason="one thread copying: the one-node bound"))  # fmt: skip
            progress.step("concurrent")
    gc.collect()
    return rows


# ---------------------------------------------------------------------- Ray scenarios


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
        if row.scenario in ("p2p-processes", "p2p-actors", "one-to-n"):
            by_method.setdefault((row.scenario, row.method), []).append(row)
    fits = []
    for (scenario, method), group in by_method.items():
        if len({r.nbytes for r in group}) < 2:
            continue
        latency, bandwidth = fit_latency_bandwidth([r.nbytes for r in group], [r.p50_us / 1e6 for r in group])
        fits.append(Fit(scenario, method, max(latency, 0.0) * 1e6, bandwidth, sorted(r.nbytes for r in group)))
    return fits


def _steps(options: Options) -> int:
    """Progress steps of the selected scenarios (forced transports are added once known)."""
    per_size = {"p2p-processes": 3, "p2p-actors": 4, "one-to-n": 3}  # memcpy + 2 autos; 4 methods; 3 methods
    steps = sum(per_size.get(s, 0) for s in options.scenarios) * len(options.sizes)
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
            rows += _process_scenarios(options, progress, notes)
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


def main(options: Options, argv: list[str], json_path: str = "", plot_path: str = "",
         echo: Callable[[str], None] = print) -> int:  # fmt: skip
    rows, fits, notes = run(options, progress_enabled=options.progress)
    echo(format_table(rows, fits))
    for note in notes:
        echo(f"skipped {note}")
    write_outputs(rows, fits, argv, json_path, plot_path)
    wrong = sum(max(r.wrong, 0) for r in rows)
    if wrong:
        echo(f"{wrong} transfer(s) delivered wrong data")
    return 1 if wrong else 0
