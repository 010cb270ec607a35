"""Same node, host memory, end to end: tensorwire's automatic choice against a bare NIXL peer.

Run: ``python -m benchmarks.same_node`` (``--rounds``, ``--cases``; ``--no-nixl`` to skip the
NIXL peer). Two processes: this one produces, a spawned one consumes into a buffer it reuses.
One *round* is timed from the start of the producer's preparation to the end of the
consumer's ``get`` (``time.perf_counter`` is the machine's one ``CLOCK_MONOTONIC``), so the
producer's work (``put`` + pickling the reference, which makes its exports) is included:

* ``new N MiB``: a new object of the same (already faulted) tensor each round;
* ``same 64 MiB``: the same reference fetched again each round;
* ``64 MiB x1024``: 1,024 tensors of 64 KiB, the same object each round;
* ``4 KiB``: one small tensor, a new object each round (inline for tensorwire).

The message between the two goes over a ``multiprocessing`` pipe. Every tensorwire round
is checked (untimed): the consumer compares its buffer with the expected bytes, then zeroes
it. Methods are interleaved round by round; the table shows medians and ``ratio`` = NIXL's
median over tensorwire's (above 1: tensorwire is faster).

The NIXL peer is :mod:`tensorwire.bench.bare_nixl` (two processes of its own, UCX backend; it
checks every round's bytes) when ``nixl`` is installed; without it the NIXL column is empty.
A new-object NIXL round is its register + partial metadata + send + load + READ, from the
producer's start to the consumer's ``DONE``, *less* the allocation and fill of the new buffer
(tensorwire's rounds put an existing tensor); a same-object round is one READ of the
registered buffer (``initialize_xfer`` + ``transfer`` + poll + release), with no message.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import pickle
import statistics
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from tensorwire.bench.ops import pattern

MIB = 1 << 20

# case -> (tensor sizes in bytes, new object each round)
CASES: dict[str, tuple[list[int], bool]] = {
    "new 64 MiB": ([64 * MIB], True),
    "new 256 MiB": ([256 * MIB], True),
    "same 64 MiB": ([64 * MIB], False),
    "64 MiB x1024": ([64 * 1024] * 1024, False),
    "4 KiB": ([4096], True),
}


def _pattern(sizes: list[int]) -> list[torch.Tensor]:
    return [pattern(n, seed=i % 251).clone() for i, n in enumerate(sizes)]


def _consumer(conn: Any) -> None:
    """The consumer process: serves ``(kind, payload)`` messages until ``None``."""
    torch.set_num_threads(1)
    import tensorwire as tw

    state: dict[str, Any] = {}
    while True:
        message = conn.recv_bytes()
        if not message:
            return
        kind, payload = message[:1], message[1:]
        if kind == b"C":  # configure a case
            sizes = pickle.loads(payload)
            state["expected"] = _pattern(sizes)
            state["out"] = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
            conn.send_bytes(b"ok")
        elif kind == b"T":  # tensorwire: a pickled reference
            ref = pickle.loads(payload)
            out = state["out"]
            tw.get(ref, out=out[0] if len(out) == 1 else out)
            conn.send_bytes(struct.pack("d", time.perf_counter()))  # the round ends here
        elif kind == b"V":  # verify, then zero
            ok = all(torch.equal(o, e) for o, e in zip(state["out"], state["expected"], strict=True))
            for o in state["out"]:
                o.zero_()
            conn.send_bytes(b"1" if ok else b"0")


def nixl_available() -> bool:
    try:
        importlib.import_module("tensorwire.bench.bare_nixl").nixl_api()
    except ImportError:
        return False
    return True


class _Nixl:
    """The bare NIXL peer: two processes of :mod:`tensorwire.bench.bare_nixl`."""

    _MODULE = "tensorwire.bench.bare_nixl"

    def __init__(self) -> None:
        from tensorwire.bench.bare_nixl import BareNixl
        from tensorwire.peers import Peer

        self.producer, self.consumer = Peer(), Peer()
        self.bare = BareNixl(self.producer, self.consumer)
        self._fill = 0

    def _call(self, worker: Any, fn: str, *args: Any) -> Any:
        return worker.call(f"{self._MODULE}:{fn}", *args, timeout_s=120)

    def prepare(self, sizes: list[int]) -> None:
        self._call(self.consumer, "register", "tw-dst", sum(sizes), len(sizes), 0, False)

    def finish(self) -> None:
        self._call(self.consumer, "unregister", "tw-dst")

    def round(self, sizes: list[int], new_each_round: bool) -> float:
        if not new_each_round:
            return self.bare.same_object(sum(sizes), 1, tensors=len(sizes))[0]
        self._fill = self._fill % 250 + 1
        src = self._call(self.producer, "register", "tw-new", sum(sizes), len(sizes), self._fill, True)
        end = self._call(self.consumer, "read_new", src["rows"], src["metadata"], "tw-dst", self._fill, 120.0)
        self._call(self.producer, "unregister", "tw-new")
        return end - src["t0"] - src["alloc_s"]

    def close(self) -> None:
        self.producer.close()
        self.consumer.close()


def _run_case(conn: Any, producer: Any, case: str, rounds: int) -> dict[str, Any]:
    import tensorwire as tw

    sizes, new_each_round = CASES[case]
    tensors = _pattern(sizes)
    conn.send_bytes(b"C" + pickle.dumps(sizes))
    conn.recv_bytes()
    value: Any = tensors[0] if len(tensors) == 1 else tensors
    same_ref = tw.put(value)

    def tensorwire_round() -> float:
        start = time.perf_counter()
        ref = tw.put(value) if new_each_round else same_ref
        conn.send_bytes(b"T" + pickle.dumps(ref))
        (end,) = struct.unpack("d", conn.recv_bytes())
        return end - start

    methods: dict[str, Callable[[], float]] = {"tensorwire": tensorwire_round}
    if producer is not None:
        producer.prepare(sizes)
        methods["nixl"] = lambda: producer.round(sizes, new_each_round)
    times: dict[str, list[float]] = {m: [] for m in methods}
    wrong = 0
    for i in range(rounds + 2):  # two warm-up rounds
        for name, fn in methods.items():
            elapsed = fn()
            if name == "tensorwire":
                conn.send_bytes(b"V")
                wrong += conn.recv_bytes() != b"1"
            if i >= 2:
                times[name].append(elapsed)
    if producer is not None:
        producer.finish()
    return {
        "tensorwire": statistics.median(times["tensorwire"]),
        "nixl": statistics.median(times["nixl"]) if "nixl" in times else None,
        "wrong": wrong,
    }


def run(cases: list[str], rounds: int, *, with_nixl: bool) -> dict[str, dict[str, Any]]:
    """{case: {"tensorwire": median s, "nixl": median s or None, "wrong": rounds}}."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=_consumer, args=(child,), daemon=True)
    process.start()
    producer = _Nixl() if with_nixl else None
    try:
        return {case: _run_case(conn, producer, case, rounds) for case in cases}
    finally:
        conn.send_bytes(b"")
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
        if producer is not None:
            producer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.same_node")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds per case (default 9)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--no-nixl", action="store_true", help="skip the bare NIXL peer")
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {list(CASES)}")
    with_nixl = not args.no_nixl and nixl_available()
    if not args.no_nixl and not with_nixl:
        print("nixl is not installed (pip install nixl==1.5.1): no NIXL column")
    results = run(cases, args.rounds, with_nixl=with_nixl)
    print(f"{'case':14s} {'NIXL ms':>9s} {'tensorwire ms':>14s} {'ratio':>7s} {'#wrong':>7s}")
    failed = False
    for case, r in results.items():
        nixl = r["nixl"]
        ratio = f"{nixl / r['tensorwire']:.2f}x" if nixl else "-"
        nixl_ms = f"{nixl * 1e3:.2f}" if nixl else "-"
        print(f"{case:14s} {nixl_ms:>9s} {r['tensorwire'] * 1e3:14.2f} {ratio:>7s} {r['wrong']:7d}")
        failed |= bool(r["wrong"])
    if failed:
        print("FAILED: wrong data delivered")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
