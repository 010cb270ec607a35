"""tensorwire's transports against a bare NIXL program between the same two processes, interleaved.

Two spawned processes (producer, consumer) run, batch by batch in turn, the bare NIXL rounds
of :mod:`tensorwire.bench.bare_nixl` and tensorwire rounds over every usable transport that
reads host memory across nodes (:func:`compared`: chosen by capabilities, one-sided first;
here nixl, ucx, gloo and host), and the automatic choice (``auto``: no transport named, the
selector's pick: shm on one node, nixl across):

* **same object**: tensorwire ``tw.get(ref, out=buffer, transport=...)`` of one object again
  and again (the reference in hand); bare: ``initialize_xfer`` + ``transfer`` + poll + release
  of pre-registered buffers (and, as NIXL's best case, one handle posted again).
* **new reference**: the same object into the same buffer, through a reference unpickled anew
  each round (what a consumer that gets its reference in a message does; the unpickling is in
  the round); bare: as for the same object (bare NIXL deserializes nothing it has not in hand).
* **new object each round**, end to end on the one monotonic clock of both processes: the
  producer allocates and fills a new tensor and puts it (tensorwire exports when the
  reference is pickled: registration included), the reference crosses to the consumer through
  the driver, which fetches into its buffer; bare: allocate, fill, register, partial metadata,
  the same trip through the driver, load, READ. tensorwire's new-object rounds run the
  one-sided transports that export a handle per object (nixl), whose cost is what they add.
* a 1,024-tensor state dict of 64 MiB, same object and new object.

Values never go inline (``TENSORWIRE_INLINE_NBYTES=0``), so 4 KiB rows measure the
transports. Every tensorwire round's bytes are checked after the timing and counted as wrong in its row
(bare rounds check themselves).
``--other-node`` makes the two processes claim different nodes and use UCX over TCP only
(``UCX_TLS=tcp,self``; the cross-node fixed cost). Also printed: the producer's first
registration of a new buffer against a cached one (the cost ``export`` pays once per storage).

Run: ``python -m benchmarks.nixl_compare`` (about 30 s here; ``--quick`` for a check).
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from typing import Any

import torch

import tensorwire as tw
from tensorwire.bench.bare_nixl import BareNixl, nixl_api, skipped
from tensorwire.bench.schema import machine
from tensorwire.peers import Peer
from tensorwire.runtime.agent import agent as runtime_agent
from tensorwire.transport.costs import MemoryKind

MIB = 1 << 20
SIZES = (4096, MIB, 64 * MIB, 256 * MIB)
REPEATS = {4096: 100, MIB: 40, 64 * MIB: 6, 256 * MIB: 3}
_state: dict[str, Any] = {}
AUTO = "auto"  # the rounds that name no transport
_M = "tensorwire.bench.nixl_compare"


# ---------------------------------------------------------------- in the workers


def _value(nbytes: int, tensors: int, fill: int) -> list[torch.Tensor]:
    sizes = [nbytes // tensors] * tensors
    sizes[-1] += nbytes - sum(sizes)
    return [torch.full((n,), fill, dtype=torch.uint8) for n in sizes]


def put(nbytes: int, tensors: int, fill: int) -> tw.Ref:
    """Producer: one object kept here (same-object rounds) until the next one: the previous is freed."""
    previous = _state.pop("kept", None)
    if previous is not None:
        tw.free(previous)
    _state["kept"] = tw.put(_value(nbytes, tensors, fill))
    return _state["kept"]


def put_new(nbytes: int, tensors: int, fill: int) -> tuple[tw.Ref, float]:
    """Producer: free the previous new object, allocate + fill + put a new one; its start time."""
    previous = _state.pop("new", None)
    if previous is not None:
        tw.free(previous)
    start = time.perf_counter()
    ref = tw.put(_value(nbytes, tensors, fill))
    _state["new"] = ref
    return ref, start


def _out(ref: tw.Ref, tensors: int) -> list[torch.Tensor]:
    key = (ref.nbytes, tensors)
    if key not in _state:
        _state[key] = _value(ref.nbytes, tensors, 0)
    return _state[key]


def _right(out: list[torch.Tensor], fill: int) -> bool:
    """Whether every byte of ``out`` is ``fill``."""
    return all(not t.numel() or int(t.min()) == fill == int(t.max()) for t in out)


def _clear(out: list[torch.Tensor]) -> None:
    for t in out:
        t.zero_()


def get_rounds(ref: tw.Ref, tensors: int, transport: str, repeats: int, fill: int) -> tuple[list[float], int]:
    """Consumer: seconds per ``tw.get(ref, out=..., transport=...)``, and how many rounds
    delivered wrong bytes (the buffer is cleared before each round and checked after it,
    both outside the timing: a round that writes nothing counts)."""
    out, named = _out(ref, tensors), _named(transport)
    tw.get(ref, out=out, transport=named)  # connection, pages of the buffer
    times, wrong = [], 0
    for _ in range(repeats):
        _clear(out)
        start = time.perf_counter()
        tw.get(ref, out=out, transport=named)
        times.append(time.perf_counter() - start)
        wrong += not _right(out, fill)
    return times, wrong


def get_anew_rounds(blob: bytes, tensors: int, transport: str, repeats: int, fill: int) -> tuple[list[float], int]:
    """Consumer: :func:`get_rounds` through a new reference each round, unpickled from ``blob``
    inside the round."""
    ref = pickle.loads(blob)
    out, named = _out(ref, tensors), _named(transport)
    tw.get(ref, out=out, transport=named)  # connection, pages of the buffer
    del ref
    times, wrong = [], 0
    for _ in range(repeats):
        _clear(out)
        start = time.perf_counter()
        tw.get(pickle.loads(blob), out=out, transport=named)
        times.append(time.perf_counter() - start)
        wrong += not _right(out, fill)
    return times, wrong


def get_new(ref: tw.Ref, tensors: int, transport: str, fill: int) -> tuple[float, bool]:
    """Consumer: fetch a new object into the buffer; the end time, and whether the bytes were
    wrong. The buffer is cleared after the check, outside the round (its start is the
    producer's): bare NIXL's new-object rounds clear nothing inside theirs either, and a round
    that writes nothing still leaves zeros, never ``fill``."""
    out = _out(ref, tensors)
    tw.get(ref, out=out, transport=_named(transport))
    end = time.perf_counter()
    wrong = not _right(out, fill)
    _clear(out)
    return end, wrong


def _named(transport: str) -> str:
    """The ``transport=`` of a round: none for ``auto`` (the selector picks)."""
    return "" if transport == AUTO else transport


def compared(agent: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """tensorwire's transports this comparison runs, by their capabilities: every usable one
    that reads host memory across nodes (one-sided first; not those whose handle carries the
    bytes), and of those the one-sided ones that export a handle per object (new objects)."""
    caps, usable = agent.capabilities(), agent.transports()
    serving = [n for n in usable if caps[n].cross_node and MemoryKind.HOST in caps[n].memory]
    serving = sorted((n for n in serving if not caps[n].carries_value), key=lambda n: not caps[n].one_sided)
    exporting = [n for n in serving if caps[n].one_sided and caps[n].needs_export and not caps[n].export_per_consumer]
    return tuple(serving), tuple(exporting)


def registration_cost(nbytes: int, name: str) -> dict:
    """Producer: transport ``name``'s ``export`` of an object on a new tensor (its first
    registration) and of a second object on the same tensor (the cached registration)."""
    agent = runtime_agent()
    transport = agent.transports()[name]
    value = torch.full((nbytes,), 1, dtype=torch.uint8)
    result = {}
    for label in ("first", "cached"):
        ref = tw.put(value)
        stored = agent.local_object(ref.state.desc.object_id, ref.state.desc.token)
        start = time.perf_counter()
        handle = transport.export(stored)
        result[label] = time.perf_counter() - start
        assert handle
        transport.release(stored)
        tw.free(ref)
    return result


# ---------------------------------------------------------------- driver


class Compare:
    def __init__(self, env: dict[str, str], other_node: bool) -> None:
        nodes = ({"TENSORWIRE_NODE_ID": "compare-a"}, {"TENSORWIRE_NODE_ID": "compare-b"}) if other_node else ({}, {})
        self.producer, self.consumer = (Peer(env={**env, **n}) for n in nodes)
        try:
            self.bare = BareNixl(self.producer, self.consumer)
        except BaseException:
            self.close()
            raise
        self.fill = 0

    def _next_fill(self) -> int:
        self.fill = self.fill % 250 + 1
        return self.fill

    def same(self, transport: str, nbytes: int, tensors: int, repeats: int) -> tuple[list[float], int]:
        """Same-object rounds: (seconds per round, rounds with wrong bytes)."""
        fill = self._next_fill()
        ref = self.producer.call(f"{_M}:put", nbytes, tensors, fill, timeout_s=300)
        times, wrong = self.consumer.call(f"{_M}:get_rounds", ref, tensors, transport, repeats, fill, timeout_s=300)
        return times, wrong

    def anew(self, transport: str, nbytes: int, tensors: int, repeats: int) -> tuple[list[float], int]:
        """New-reference rounds: (seconds per round, rounds with wrong bytes)."""
        fill = self._next_fill()
        ref = self.producer.call(f"{_M}:put", nbytes, tensors, fill, timeout_s=300)
        args = (pickle.dumps(ref), tensors, transport, repeats, fill)
        times, wrong = self.consumer.call(f"{_M}:get_anew_rounds", *args, timeout_s=300)
        return times, wrong

    def new(self, transport: str, nbytes: int, tensors: int, repeats: int) -> tuple[list[float], int]:
        """New-object rounds: (seconds per round, rounds with wrong bytes)."""
        times, wrong = [], 0
        for _ in range(repeats):
            fill = self._next_fill()
            ref, start = self.producer.call(f"{_M}:put_new", nbytes, tensors, fill, timeout_s=300)
            end, bad = self.consumer.call(f"{_M}:get_new", ref, tensors, transport, fill, timeout_s=300)
            times.append(end - start)
            wrong += bad
        return times, wrong

    def close(self) -> None:
        self.producer.close()
        self.consumer.close()


def _ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def run(  # noqa: PLR0917 - the benchmark's knobs
    sizes: tuple[int, ...],
    repeats_of: dict[int, int],
    rounds: int,
    other_node: bool,
    dict_nbytes: int,
    transports: tuple[str, ...],
    exporting: tuple[str, ...],
    costs_too: bool = True,
) -> dict:
    """{case: {method: median ms}}, the methods' batches interleaved ``rounds`` times (``transports``: the
    tensorwire ones; ``exporting``: those that also run new-object rounds; ``costs_too``: also time their
    first and cached registrations)."""
    env = {"OMP_NUM_THREADS": "1", "TENSORWIRE_INLINE_NBYTES": "0"}  # 4 KiB over nixl too, not inline
    results: dict[str, dict[str, list[float]]] = {}
    wrong: dict[str, dict[str, int]] = {}  # case -> tensorwire method -> rounds with wrong bytes
    cases_of: dict[str, tuple[int, int]] = {}  # case -> (bytes, tensors)
    costs, bare_costs, c = {}, {}, None
    try:
        c = Compare({**env, **({"UCX_TLS": "tcp,self"} if other_node else {})}, other_node)
        cases = [(f"{n} B", n, 1, repeats_of[n]) for n in sizes]
        cases.append((f"{dict_nbytes >> 20} MiB as 1,024 tensors", dict_nbytes, 1024, 4))
        for _ in range(rounds):
            for label, nbytes, tensors, repeats in cases:
                same = results.setdefault(f"same object, {label}", {})
                anew = results.setdefault(f"new reference, {label}", {})
                new = results.setdefault(f"new object, {label}", {})
                for mode in ("same object", "new reference", "new object"):
                    cases_of[f"{mode}, {label}"] = (nbytes, tensors)
                bare = c.bare.same_object(nbytes, repeats, tensors=tensors)
                same.setdefault("bare NIXL", []).extend(bare)
                anew.setdefault("bare NIXL", []).extend(bare)
                same.setdefault("bare NIXL, handle reused", []).extend(
                    c.bare.same_object(nbytes, repeats, tensors=tensors, reuse=True)
                )
                for transport in (*transports, AUTO):
                    times, bad = c.same(transport, nbytes, tensors, repeats)
                    same.setdefault(f"tensorwire {transport}", []).extend(times)
                    _count(wrong, f"same object, {label}", f"tensorwire {transport}", bad)
                    times, bad = c.anew(transport, nbytes, tensors, repeats)
                    anew.setdefault(f"tensorwire {transport}", []).extend(times)
                    _count(wrong, f"new reference, {label}", f"tensorwire {transport}", bad)
                new_repeats = max(2, repeats // 4)
                new.setdefault("bare NIXL", []).extend(c.bare.new_object(nbytes, new_repeats, tensors=tensors)["times"])
                for transport in (*exporting, AUTO):
                    times, bad = c.new(transport, nbytes, tensors, new_repeats)
                    new.setdefault(f"tensorwire {transport}", []).extend(times)
                    _count(wrong, f"new object, {label}", f"tensorwire {transport}", bad)
        if costs_too:
            costs = {
                (name, n): c.producer.call(f"{_M}:registration_cost", n, name, timeout_s=300)
                for name in exporting
                for n in (MIB, 64 * MIB)
            }
            bare_costs = {n: c.bare.registration_cost(n) for n in (MIB, 64 * MIB)}
    finally:
        if c is not None:
            c.close()
    table = {case: {m: _ms(t) for m, t in methods.items()} for case, methods in results.items()}
    return {
        "table": table,
        "times": results,
        "wrong": wrong,
        "cases": cases_of,
        "costs": costs,
        "bare_costs": bare_costs,
    }


def _count(wrong: dict[str, dict[str, int]], case: str, method: str, bad: int) -> None:
    per_case = wrong.setdefault(case, {})
    per_case[method] = per_case.get(method, 0) + int(bad)


def bench_rows(options: Any, progress: Any, notes: list[str]) -> list[Any]:
    """``tensorwire bench --scenarios nixl-compare``: :func:`run` between two processes on this node, then between
    two that claim different nodes (UCX over TCP), at the bench's sizes and a 1,024-tensor value of the largest,
    in two interleaved batches: per batch ``--iters`` same-object rounds per size (4 for 1,024 tensors), a quarter
    as many new-object rounds (at least 2); each method's first fetch is its warm-up. Every tensorwire round is
    checked and a wrong one counted in its row's ``#wrong`` (the run goes on); a bare NIXL round that is wrong
    ends the run (the reference itself is broken). A row per case, method and placement; the transports usable
    here only."""
    from tensorwire.bench.schema import make_row

    agent = runtime_agent()
    transports, exporting = compared(agent)
    why = _why_not_run(agent, exporting) or ("it needs sizes of 1 KiB or more" if min(options.sizes) < 1024 else "")
    if why:
        notes.append(f"nixl-compare: skipped ({why})")
        progress.total -= 2
        return []
    sizes, rows = tuple(options.sizes), []
    for where, other_node in (("same node", False), ("other node, UCX tcp", True)):
        repeats = dict.fromkeys(sizes, max(1, options.iterations))
        out = run(sizes, repeats, 2, other_node, sizes[-1], transports=transports, exporting=exporting, costs_too=False)
        for case, methods in out["times"].items():
            (nbytes, tensors), mode = out["cases"][case], case.split(",")[0]
            made = {}
            for method, times in methods.items():
                transport = method.split()[1] if method.startswith("tensorwire") else "nixl"  # bare: the library
                made[method] = make_row(
                    "nixl-compare",
                    f"{method}, {mode} ({where})",
                    {"times": times, "wrong": out["wrong"].get(case, {}).get(method, 0)},  # (bare: raises)
                    baseline=method.startswith("bare"),
                    nbytes=nbytes,
                    tensors=tensors,
                    transport=transport,
                    reason=_REASONS[mode],
                )
            best = min(r.p50_us for r in made.values() if r.baseline)  # this case's bare rows only
            for row in made.values():
                if not row.baseline:
                    row.vs_best_baseline = best / row.p50_us
            rows += made.values()
        progress.step(f"nixl-compare ({where})")
    return rows


def _why_not_run(agent: Any, exporting: tuple[str, ...]) -> str:
    """Why the comparison cannot run here ("" when it can): bare NIXL is not installed, or no
    one-sided transport that exports per object reads across nodes here."""
    try:
        nixl_api()
    except ImportError as e:
        return f"bare NIXL: {e}"
    if exporting:
        return ""
    caps = agent.capabilities()
    candidates = [n for n, c in caps.items() if c.one_sided and c.cross_node and c.needs_export]
    unusable = agent.unusable_transports()
    reasons = "; ".join(f"{n}: {unusable.get(n, 'usable')}" for n in candidates) or "none registered"
    return f"no one-sided transport that exports per object reads across nodes here ({reasons})"


_REASONS = {
    "same object": "the reference in hand; bare: a READ of registered buffers",
    "new reference": "the same object, a reference unpickled anew each round; bare: a READ of registered buffers",
    "new object": "end to end: put + the trip + get; bare: register + metadata + the trip + READ",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.nixl_compare")
    parser.add_argument("--quick", action="store_true", help="4 KiB and 1 MiB, a 4 MiB dict, one round (a check)")
    parser.add_argument("--other-node", action="store_true", help="claim two nodes, UCX over TCP only")
    parser.add_argument("--transports", default="", help="comma-separated tensorwire transports to run (default: all)")
    parser.add_argument("--sizes", default="", help="comma-separated byte sizes (default: 4 KiB to 256 MiB)")
    args = parser.parse_args(argv)
    if skipped():
        return 0
    sizes = tuple(int(n) for n in args.sizes.split(",")) if args.sizes else (4096, MIB) if args.quick else SIZES
    repeats = {n: 3 if args.quick else REPEATS.get(n, 6) for n in sizes}
    transports, exporting = compared(runtime_agent())
    if args.transports:
        wanted = args.transports.split(",")
        transports = tuple(t for t in transports if t in wanted)
        exporting = tuple(t for t in exporting if t in wanted)
    dict_nbytes = 4 * MIB if args.quick else 64 * MIB
    out = run(sizes, repeats, 1 if args.quick else 2, args.other_node, dict_nbytes, transports, exporting)
    facts = machine()
    print(
        f"median ms; two processes; {facts['cores']} cores, {facts['cpu']}; "
        f"{'other node, UCX tcp' if args.other_node else 'same node'}"
    )
    for case, methods in out["table"].items():
        bare = methods["bare NIXL"]
        cells = ", ".join(
            f"{m} {v:.3f}" + (f" ({bare / v:.2f}x bare)" if m.startswith("tensorwire") else "")
            for m, v in methods.items()
        )
        print(f"{case}: {cells}")
    for (name, n), cost in out["costs"].items():
        bare = out["bare_costs"][n]
        print(
            f"{name} export of {n} B: first {cost['first'] * 1e3:.3f} ms, cached {cost['cached'] * 1e3:.3f} ms; "
            f"bare register {bare['register_s'] * 1e3:.3f} ms, "
            f"deregister {bare['deregister_s'] * 1e3:.3f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
