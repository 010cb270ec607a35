"""A bare NIXL program between two processes: the baseline tensorwire is compared against.

No tensorwire here: two spawned processes (:class:`tensorwire.peers.Peer`) each make one
``nixl_agent`` (UCX backend) and exchange their agent metadata once through the driver. Then:

* **same object** (:meth:`BareNixl.same_object`): the producer allocates, fills and registers a
  buffer once; the consumer registers its destination once and times each round as a user of
  NIXL pays it with the descriptors already in hand: ``initialize_xfer`` (READ) + ``transfer``
  + polling ``check_xfer_state`` to ``DONE`` + ``release_xfer_handle`` (``reuse=True``: one
  handle made once and posted again each round, NIXL's best case).
* **new object each round** (:meth:`BareNixl.new_object`): per round the producer allocates a
  new buffer, fills it, registers it and takes its *partial* agent metadata (the consumer
  loaded the connection at set-up, so only the new registration travels); the descriptors and
  metadata go to the consumer (pickled through the driver, as any user must send them
  somehow), which loads the metadata and READs into its registered destination. A round is
  timed end to end: from the producer's allocation to the consumer's ``DONE``, on the one
  monotonic clock both processes share (``time.perf_counter`` is ``CLOCK_MONOTONIC`` on
  Linux). Deregistration afterwards is timed on its own (``dereg_s``), not in the round.
* **state dict** (``tensors=1024``, either mode): the producer's value is that many separate
  tensors adding up to ``nbytes``, registered in one ``register_memory`` call with one
  descriptor each; the consumer reads them with one 1,024-descriptor READ into as many
  registered destination tensors.

Every round's data is checked after the timing (the fill byte changes per round); a wrong
byte raises ``AssertionError``. Every wait is bounded (``timeout_s``).

Function API (the same two processes can run tensorwire rounds in between, interleaved)::

    from tensorwire.bench.bare_nixl import BareNixl, nixl_api
    from tensorwire.peers import Peer

    producer, consumer = Peer(), Peer()
    bare = BareNixl(producer, consumer)          # makes one agent in each, loads metadata once
    times = bare.same_object(64 << 20, repeats=10)            # seconds per READ round
    times = bare.same_object(64 << 20, repeats=10, reuse=True)  # one handle, posted again
    times = bare.new_object(64 << 20, repeats=5)              # seconds per end-to-end round
    times = bare.same_object(64 << 20, repeats=5, tensors=1024)
    costs = bare.registration_cost(64 << 20)     # {"register_s", "deregister_s", "metadata_s"}
    bare.close()                                 # deregisters everything, agents stay until exit

Each method returns a list of seconds (``new_object`` returns a dict with ``times`` and
``dereg_s``). ``nixl_api()`` imports NIXL's Python API from whichever wheel is installed
(``nixl._api``, else ``nixl_cu12._api``, else ``nixl_cu13._api``).

Run: ``python -m tensorwire.bench.bare_nixl`` (about a minute here; ``--quick``: 1 MiB only).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import statistics
import sys
import time
from typing import Any

import torch

from tensorwire.peers import Peer
from tensorwire.transport.config import ucxx_settings_hidden

MIB = 1 << 20
SIZES = (4096, 1 * MIB, 64 * MIB, 256 * MIB)
REPEATS = {4096: 200, 1 * MIB: 50, 64 * MIB: 8, 256 * MIB: 4}
_MODULE = "tensorwire.bench.bare_nixl"
_state: dict[str, Any] = {}


def nixl_api() -> Any:
    """NIXL's ``_api`` module from the installed wheel (``nixl``, else ``nixl_cu12``, else
    ``nixl_cu13``); ``ImportError`` names the install."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # else NIXL prints INFO lines to stdout
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        with contextlib.suppress(ImportError):
            return importlib.import_module(name)
    raise ImportError("NIXL is not installed: pip install 'tensorwire[nixl]' (or nixl-cu12)")


def skipped() -> bool:
    """Whether NIXL is missing; says so on stdout (a benchmark's main then returns 0)."""
    try:
        nixl_api()
    except ImportError as e:
        print(f"skipped: {e}")
        return True
    return False


# ---------------------------------------------------------------- run inside the workers


def make_agent(name: str) -> Any:
    """One agent, UCX backend, its progress thread pausing ``BARE_NIXL_PROGRESS_US`` between
    polls (default ``TENSORWIRE_NIXL_PROGRESS_US``, else 1000: the pause tensorwire's nixl
    transport sets; 0 is NIXL's default, a spin), thread-safe as tensorwire's (``sync_mode``
    RW). The spin keeps a core busy in each process for as long as it lives (measured: 2.0
    CPU-s in 2 s idle, 0.07 with a pause): on two cores the two bare processes would slow
    every method measured beside them, tensorwire's rounds included. The UCX settings that
    importing ucxx writes are hidden meanwhile, as tensorwire hides them from its own agent
    (``UCX_RNDV_THRESH=8192`` made a 1 MiB READ 9x slower)."""
    api = nixl_api()
    pause_us = int(os.environ.get("BARE_NIXL_PROGRESS_US", os.environ.get("TENSORWIRE_NIXL_PROGRESS_US", "1000")))
    sync = getattr(api, "nixl_thread_sync_t", None)
    config = api.nixl_agent_config(backends=["UCX"], **({"sync_mode": sync.NIXL_THREAD_SYNC_RW} if sync else {}))
    bind, make = api.nixlBind, api.nixlBind.nixlAgent  # called with the config the API built

    def paused(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = pause_us
        return make(agent_name, agent_config)

    # Under the lock that also orders tensorwire's own agent-making (ucxx_settings_hidden holds
    # it): both patch the API's constructor meanwhile.
    with ucxx_settings_hidden():
        bind.nixlAgent = paused
        try:
            return api.nixl_agent(name, config)
        finally:
            bind.nixlAgent = make


def start(role: str) -> bytes:
    """Make this process's agent (once); returns its full metadata."""
    if "agent" not in _state:
        _state["agent"] = make_agent(f"bare-{role}-{os.getpid()}")
        _state["regs"] = {}  # key -> (tensors, reg descs)
    return _state["agent"].get_agent_metadata()


def load(metadata: bytes) -> str:
    """Load the other agent's metadata (connection and registrations); returns its name."""
    name = _state["agent"].add_remote_agent(metadata)
    _state["peer"] = name
    return name


def _alloc(nbytes: int, tensors: int, fill: int) -> list[torch.Tensor]:
    sizes = [nbytes // tensors] * tensors
    sizes[-1] += nbytes - sum(sizes)
    out = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    for t in out:
        t.fill_(fill)
    return out


def _rows(tensors: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    return [(t.data_ptr(), t.numel(), 0) for t in tensors]


def register(key: str, nbytes: int, tensors: int, fill: int, partial: bool) -> dict:
    """Producer or consumer: allocate ``tensors`` buffers adding up to ``nbytes``, fill them,
    register them; returns the descriptors, the partial metadata (``partial``) and times."""
    agent = _state["agent"]
    t0 = time.perf_counter()
    bufs = _alloc(nbytes, tensors, fill)
    t1 = time.perf_counter()
    regs = agent.register_memory([(p, n, d, "") for p, n, d in _rows(bufs)], "DRAM")
    t2 = time.perf_counter()
    meta = agent.get_partial_agent_metadata(regs, False) if partial else b""
    t3 = time.perf_counter()
    _state["regs"][key] = (bufs, regs)
    return {
        "rows": _rows(bufs),
        "metadata": meta,
        "t0": t0,
        "alloc_s": t1 - t0,
        "register_s": t2 - t1,
        "metadata_s": t3 - t2,
    }


def unregister(key: str) -> float:
    """Deregister and drop ``key``'s buffers; returns the seconds it took."""
    start_s = time.perf_counter()
    bufs, regs = _state["regs"].pop(key)
    _state["agent"].deregister_memory(regs)
    del bufs
    return time.perf_counter() - start_s


def _xfer(remote_rows: list[tuple[int, int, int]], local_key: str) -> Any:
    agent = _state["agent"]
    local = agent.get_xfer_descs(_rows(_state["regs"][local_key][0]), "DRAM")
    remote = agent.get_xfer_descs(remote_rows, "DRAM")
    return agent.initialize_xfer("READ", local, remote, _state["peer"])


def _post_and_wait(handle: Any, timeout_s: float) -> None:
    agent = _state["agent"]
    state = agent.transfer(handle)
    deadline = time.monotonic() + timeout_s
    spins = 0
    while state == "PROC":
        if time.monotonic() > deadline:
            raise TimeoutError(f"bare NIXL READ still in progress after {timeout_s} s")
        state = agent.check_xfer_state(handle)
        spins += 1
        if spins > 200:  # let the other process's progress thread run (2 cores): as tensorwire's poll does
            time.sleep(0)
    if state != "DONE":
        raise RuntimeError(f"bare NIXL READ ended in state {state}")


def _read(remote_rows: list[tuple[int, int, int]], local_key: str, timeout_s: float) -> None:
    handle = _xfer(remote_rows, local_key)
    try:
        _post_and_wait(handle, timeout_s)
    finally:
        _state["agent"].release_xfer_handle(handle)


def _check(local_key: str, fill: int) -> None:
    for t in _state["regs"][local_key][0]:
        if t.numel() and not (int(t.min()) == fill == int(t.max())):
            raise AssertionError(f"bare NIXL READ delivered wrong bytes (expected all {fill})")


def read_rounds(  # noqa: PLR0917 - one call per case
    remote_rows: list, metadata: bytes, local_key: str, repeats: int, fill: int, timeout_s: float, reuse: bool
) -> list[float]:
    """Consumer: load ``metadata`` (untimed), then ``repeats`` timed READs of ``remote_rows``
    into ``local_key`` (``reuse``: one transfer handle made once and posted again each round,
    NIXL's best case; else a handle made and released per round); checked after."""
    _state["agent"].add_remote_agent(metadata)
    _read(remote_rows, local_key, timeout_s)  # warm: connection, pages of the destination
    times = []
    handle = _xfer(remote_rows, local_key) if reuse else None
    try:
        for _ in range(repeats):
            start_s = time.perf_counter()
            if handle is None:
                _read(remote_rows, local_key, timeout_s)
            else:
                _post_and_wait(handle, timeout_s)
            times.append(time.perf_counter() - start_s)
    finally:
        if handle is not None:
            _state["agent"].release_xfer_handle(handle)
    _check(local_key, fill)
    return times


def read_new(remote_rows: list, metadata: bytes, local_key: str, fill: int, timeout_s: float) -> float:
    """Consumer, new-object round: load the partial metadata, READ; returns the end time."""
    _state["agent"].add_remote_agent(metadata)
    _read(remote_rows, local_key, timeout_s)
    end = time.perf_counter()
    _check(local_key, fill)
    return end


# ---------------------------------------------------------------- driver


class BareNixl:
    """Bare NIXL between ``producer`` and ``consumer`` (two Peers); see the module docstring."""

    def __init__(self, producer: Peer, consumer: Peer, *, timeout_s: float = 120.0) -> None:
        self.producer, self.consumer, self.timeout_s = producer, consumer, timeout_s
        producer_md = producer.call(f"{_MODULE}:start", "producer", timeout_s=timeout_s)
        consumer_md = consumer.call(f"{_MODULE}:start", "consumer", timeout_s=timeout_s)
        consumer.call(f"{_MODULE}:load", producer_md, timeout_s=timeout_s)
        producer.call(f"{_MODULE}:load", consumer_md, timeout_s=timeout_s)  # not needed for READ; symmetric
        self._keys: list[tuple[Peer, str]] = []
        self._round = 0

    def _call(self, worker: Peer, fn: str, *args: Any) -> Any:
        return worker.call(f"{_MODULE}:{fn}", *args, timeout_s=self.timeout_s)

    def _fill(self) -> int:
        self._round += 1
        return self._round % 251

    def same_object(self, nbytes: int, repeats: int, *, tensors: int = 1, reuse: bool = False) -> list[float]:
        """Seconds per READ of one pre-registered object into a pre-registered destination
        (``reuse``: the transfer handle is made once and posted again, NIXL's best case)."""
        fill = self._fill()
        key = f"same-{self._round}"
        src = self._call(self.producer, "register", key, nbytes, tensors, fill, True)
        self._call(self.consumer, "register", key, nbytes, tensors, 0, False)
        try:
            args = (src["rows"], src["metadata"], key, repeats, fill, self.timeout_s, reuse)
            return self._call(self.consumer, "read_rounds", *args)
        finally:
            self._call(self.producer, "unregister", key)
            self._call(self.consumer, "unregister", key)

    def new_object(self, nbytes: int, repeats: int, *, tensors: int = 1) -> dict:
        """End-to-end seconds per round of a new object (allocate, fill, register, partial
        metadata, send, load, READ); ``dereg_s``: the producer's deregistration per round."""
        key = f"dst-{self._round}"
        self._call(self.consumer, "register", key, nbytes, tensors, 0, False)
        times, dereg = [], []
        try:
            for _ in range(repeats):
                fill = self._fill()
                src = self._call(self.producer, "register", "new", nbytes, tensors, fill, True)
                end = self._call(self.consumer, "read_new", src["rows"], src["metadata"], key, fill, self.timeout_s)
                times.append(end - src["t0"])
                dereg.append(self._call(self.producer, "unregister", "new"))
        finally:
            self._call(self.consumer, "unregister", key)
        return {"times": times, "dereg_s": dereg}

    def registration_cost(self, nbytes: int, *, tensors: int = 1) -> dict:
        """The producer's allocation, registration, partial-metadata and deregistration
        seconds for one new buffer of ``nbytes`` (one sample)."""
        src = self._call(self.producer, "register", "cost", nbytes, tensors, 1, True)
        dereg = self._call(self.producer, "unregister", "cost")
        return {
            "alloc_s": src["alloc_s"],
            "register_s": src["register_s"],
            "metadata_s": src["metadata_s"],
            "deregister_s": dereg,
            "metadata_nbytes": len(src["metadata"]),
        }

    def close(self) -> None:
        """Nothing is left registered between calls; the agents go when the workers exit."""


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 0.01 else f"{seconds * 1e3:.1f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 MiB and a 1,024-tensor 4 MiB dict, few repeats")
    args = parser.parse_args(argv)
    if skipped():
        return 0
    sizes = (1 * MIB,) if args.quick else SIZES
    env = {"OMP_NUM_THREADS": "1"}
    producer, consumer = Peer(env=env), Peer(env=env)
    try:
        bare = BareNixl(producer, consumer)
        print(f"{'case':<40} {'median':>12} {'min':>12}")
        for nbytes in sizes:
            repeats = 3 if args.quick else REPEATS[nbytes]
            same = bare.same_object(nbytes, repeats)
            reused = bare.same_object(nbytes, repeats, reuse=True)
            new = bare.new_object(nbytes, max(2, repeats // 4))
            cases = (
                (f"same object {nbytes} B", same),
                (f"same object, handle reused {nbytes} B", reused),
                (f"new object {nbytes} B", new["times"]),
            )
            for label, times in cases:
                print(f"{label:<40} {_fmt(statistics.median(times)):>12} {_fmt(min(times)):>12}")
            cost = bare.registration_cost(nbytes)
            print(
                f"{'  register / deregister ' + str(nbytes) + ' B':<40} {_fmt(cost['register_s']):>12} "
                f"{_fmt(cost['deregister_s']):>12}"
            )
        dict_bytes = 4 * MIB if args.quick else 64 * MIB
        for mode in ("same", "new"):
            if mode == "same":
                times = bare.same_object(dict_bytes, 3 if args.quick else 8, tensors=1024)
            else:
                times = bare.new_object(dict_bytes, 2 if args.quick else 4, tensors=1024)["times"]
            label = f"{mode} object 1,024 tensors {dict_bytes} B"
            print(f"{label:<40} {_fmt(statistics.median(times)):>12} {_fmt(min(times)):>12}")
    finally:
        producer.close()
        consumer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
