"""What the benchmark runs inside its processes: tensorwire fetches and the bare baselines.

Every function here is called in a peer process (the consumer) or in the benchmark's own
process (the producer of bare transfers). Timed loops return seconds per iteration; data is a
byte pattern that ``check`` compares after the timed part of every iteration, and with
``check`` every receive buffer is zeroed before every timed iteration (outside the timing), so
an iteration that writes nothing fails instead of passing on what an earlier one left.

Bare baselines do what tensorwire does per transfer, written directly on the library: the
consumer asks (a 1-byte message), the producer sends, the consumer's time runs from asking to
having the bytes. So both sides of a comparison pay one request and one transfer.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import numpy as np
import torch

__all__ = ["dispatch", "make_value", "matches", "pattern"]

_state: dict[str, Any] = {}


def pattern(nbytes: int, seed: int = 0, device: Any = None) -> torch.Tensor:
    """``nbytes`` bytes of a fixed pattern, ``(position + seed) % 251`` (differs between seeds
    and positions), made by tiling one period: no temporary larger than the result."""
    period = ((torch.arange(251, dtype=torch.int64) + seed) % 251).to(torch.uint8)
    if device is not None:
        period = period.to(device)
    return period.repeat(nbytes // 251 + 1)[:nbytes]


def make_value(nbytes: int, tensors: int, seed: int = 0) -> torch.Tensor | list[torch.Tensor]:
    """One tensor of ``nbytes``, or a list of ``tensors`` tensors adding up to it; ``seed``
    changes every byte (rounds of a checked benchmark use different seeds)."""
    if tensors == 1:
        return pattern(nbytes, seed=seed)
    per = max(1, nbytes // tensors)
    return [pattern(per, seed=seed + i) for i in range(tensors)]


_expected: dict[tuple[int, int, int], Any] = {}


def matches(value: Any, nbytes: int, tensors: int, seed: int = 0) -> bool:
    """Whether ``value`` holds exactly what :func:`make_value` makes (expected values are
    made once per shape and seed and kept, a few at a time, so checking costs a comparison)."""
    key = (nbytes, tensors, seed % 251)
    if key not in _expected:
        if len(_expected) >= 4:
            _expected.clear()
        _expected[key] = make_value(nbytes, tensors, seed)
    expected = _expected[key]
    if isinstance(expected, torch.Tensor):
        return bool(torch.equal(value.cpu(), expected))
    return len(value) == len(expected) and all(torch.equal(v.cpu(), e) for v, e in zip(value, expected, strict=True))


def _zero(value: Any) -> None:
    for t in value if isinstance(value, list) else [value]:
        t.zero_()


# ---------------------------------------------------------------------- tensorwire


def hold(nbytes: int, tensors: int) -> Any:
    """Producer: put a value and keep it; its reference (for consumers elsewhere)."""
    import tensorwire as tw

    ref = tw.put(make_value(nbytes, tensors))
    _state.setdefault("held", []).append(ref)
    return ref


def tw_fetch(  # noqa: PLR0917 - called positionally through the peer pipe
    ref: Any, transport: str, device: str | None, nbytes: int, tensors: int, iterations: int, warmups: int, check: bool
) -> dict:
    """Consumer: ``tw.get(ref, out=buffers)`` timed per iteration (request + transfer);
    the buffers are on ``device`` (None: where ``tw.get`` puts the value by default)."""
    import tensorwire as tw

    out = tw.get(ref, transport=transport, device=device, timeout_s=120)  # connects, maps, gives the buffers
    for _ in range(warmups):
        tw.get(ref, out=out, transport=transport, timeout_s=120)
    times, wrong = [], 0
    for _ in range(iterations):
        if check:
            _zero(out)
        start = time.perf_counter()
        tw.get(ref, out=out, transport=transport, timeout_s=120)
        times.append(time.perf_counter() - start)
        if check and not matches(out, nbytes, tensors):
            wrong += 1
    record = tw.stats()["recent"][-1]
    return {"times": times, "wrong": wrong if check else -1, "transport": record.transport, "reason": record.reason}


# ---------------------------------------------------------------------- bare ucxx


def ucx_start() -> bytes:
    from ucxx._lib import libucxx as ucx_api

    context = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
    worker = ucx_api.UCXWorker(context)
    worker.start_progress_thread(polling_mode=False, epoll_timeout=1)
    _state.update(ucx_api=ucx_api, ucx_context=context, ucx_worker=worker)
    return bytes(worker.address)


def ucx_connect(address: bytes) -> None:
    api, worker = _state["ucx_api"], _state["ucx_worker"]
    _state["ucx_ep"] = api.UCXEndpoint.create_from_worker_address(
        worker, api.UCXAddress.create_from_buffer(address), False
    )


def _ucx_wait(request: Any, deadline: float) -> None:
    while not request.completed:
        if time.monotonic() > deadline:
            raise TimeoutError("bare ucxx: a transfer did not complete in time")
        time.sleep(0)
    request.check_error()


def ucx_serve(nbytes: int, count: int) -> None:
    """Producer: for each of ``count`` requests (tag 2i), send the data (tag 2i+1)."""
    from ucxx._lib.arr import Array

    api, ep = _state["ucx_api"], _state["ucx_ep"]
    data, ask = pattern(nbytes).numpy(), np.empty(1, dtype=np.uint8)
    deadline = time.monotonic() + 600
    for i in range(count):
        _ucx_wait(ep.tag_recv(Array(ask), api.UCXXTag(2 * i)), deadline)
        _ucx_wait(ep.tag_send(Array(data), api.UCXXTag(2 * i + 1)), deadline)


def ucx_fetch(nbytes: int, iterations: int, warmups: int, check: bool) -> dict:
    """Consumer: ask, receive; timed per iteration."""
    from ucxx._lib.arr import Array

    api, ep = _state["ucx_api"], _state["ucx_ep"]
    out, ask = np.zeros(nbytes, dtype=np.uint8), np.ones(1, dtype=np.uint8)
    deadline = time.monotonic() + 600
    times, wrong = [], 0
    for i in range(warmups + iterations):
        if check:
            out[:] = 0
        start = time.perf_counter()
        receive = ep.tag_recv(Array(out), api.UCXXTag(2 * i + 1))
        _ucx_wait(ep.tag_send(Array(ask), api.UCXXTag(2 * i)), deadline)
        _ucx_wait(receive, deadline)
        if i >= warmups:
            times.append(time.perf_counter() - start)
            if check and not matches(torch.from_numpy(out), nbytes, 1):
                wrong += 1
    return {"times": times, "wrong": wrong if check else -1}


def ucx_stop() -> None:
    endpoint = _state.pop("ucx_ep", None)
    if endpoint is not None:
        endpoint.close()
    worker = _state.pop("ucx_worker", None)
    if worker is not None:
        worker.stop_progress_thread()


# ---------------------------------------------------------------------- bare torch.distributed (gloo)


def gloo_join(host: str, port: int, rank: int) -> int:
    """Rank 0 (the producer) makes the store and returns its port; rank 1 joins it."""
    import torch.distributed as dist

    store = dist.TCPStore(
        host, port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    _state["gloo_store"] = store
    if rank == 0:
        threading.Thread(target=_gloo_group, args=(0,), daemon=True).start()
    else:
        _gloo_group(1)
    return store.port


def _gloo_group(rank: int) -> None:
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = datetime.timedelta(seconds=120)
    _state["gloo"] = dist.ProcessGroupGloo(_state["gloo_store"], rank, 2, options)


def gloo_wait_ready(timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while "gloo" not in _state:
        if time.monotonic() > deadline:
            raise TimeoutError("bare gloo: the group did not form")
        time.sleep(0.01)


def gloo_serve(nbytes: int, count: int) -> None:
    group, data, ask = _state["gloo"], pattern(nbytes), torch.empty(1, dtype=torch.uint8)
    for i in range(count):
        group.recv([ask], 1, 2 * i).wait()
        group.send([data], 1, 2 * i + 1).wait()


def gloo_fetch(nbytes: int, iterations: int, warmups: int, check: bool) -> dict:
    group = _state["gloo"]
    out, ask = torch.zeros(nbytes, dtype=torch.uint8), torch.ones(1, dtype=torch.uint8)
    times, wrong = [], 0
    for i in range(warmups + iterations):
        if check:
            out.zero_()
        start = time.perf_counter()
        receive = group.recv([out], 0, 2 * i + 1)
        group.send([ask], 0, 2 * i).wait()
        receive.wait()
        if i >= warmups:
            times.append(time.perf_counter() - start)
            if check and not matches(out, nbytes, 1):
                wrong += 1
    return {"times": times, "wrong": wrong if check else -1}


def gloo_stop() -> None:
    _state.pop("gloo", None)
    _state.pop("gloo_store", None)


# ---------------------------------------------------------------------- bare NIXL (one-sided READ)


def nixl_start(role: str) -> None:
    """A NIXL agent of this benchmark's own, besides tensorwire's: UCX backend, its progress
    thread pausing as tensorwire's does (NIXL's default spin would slow both sides here)."""
    from tensorwire.bench.bare_nixl import make_agent

    _state["nixl"] = make_agent(f"bench-{role}-{time.monotonic_ns()}")


def nixl_offer(nbytes: int) -> tuple[bytes, list[tuple[int, int, int]]]:
    """Producer: register the pattern of ``nbytes`` (kept until :func:`nixl_stop`); the agent's
    metadata, which names the registration, and the buffer's descriptor rows."""
    agent, data = _state["nixl"], pattern(nbytes)
    _state.setdefault("nixl_regs", []).append((data, agent.register_memory([(data.data_ptr(), nbytes, 0, "")], "DRAM")))
    return agent.get_agent_metadata(), [(data.data_ptr(), nbytes, 0)]


def nixl_fetch(  # noqa: PLR0917 - called positionally through the peer pipe
    metadata: bytes, rows: list, nbytes: int, iterations: int, warmups: int, check: bool
) -> dict:
    """Consumer: READ the offered buffer into a registered one; a transfer handle made and
    released per READ (as tensorwire's nixl does per fetch); timed per READ."""
    agent = _state["nixl"]
    peer, out = agent.add_remote_agent(metadata), torch.zeros(nbytes, dtype=torch.uint8)
    registered = agent.register_memory([(out.data_ptr(), nbytes, 0, "")], "DRAM")
    local, remote = agent.get_xfer_descs([(out.data_ptr(), nbytes, 0)], "DRAM"), agent.get_xfer_descs(rows, "DRAM")
    deadline, times, wrong = time.monotonic() + 600, [], 0
    try:
        for i in range(warmups + iterations):
            if check:
                out.zero_()
            start = time.perf_counter()
            handle, state, spins = agent.initialize_xfer("READ", local, remote, peer), "ERR", 0
            try:
                state = agent.transfer(handle)
                while state == "PROC" and time.monotonic() < deadline:
                    state = agent.check_xfer_state(handle)
                    if (spins := spins + 1) > 200:  # let the progress threads run (two cores), as tensorwire's does
                        time.sleep(0)
            finally:
                if state != "PROC":  # one still running may land later: its handle and memory are kept
                    agent.release_xfer_handle(handle)
            if state != "DONE":
                _state.setdefault("nixl_kept", []).append((out, registered))
                registered = None
                raise RuntimeError(f"bare NIXL: a READ ended {state}")
            if i >= warmups:
                times.append(time.perf_counter() - start)
                wrong += check and not matches(out, nbytes, 1)
    finally:
        if registered is not None:
            agent.deregister_memory(registered)
        agent.remove_remote_agent(peer)
    return {"times": times, "wrong": wrong if check else -1}


def nixl_stop() -> None:
    agent = _state.pop("nixl", None)
    for _data, registered in _state.pop("nixl_regs", []):
        agent.deregister_memory(registered)


# ---------------------------------------------------------------------- memcpy (the bound on one node)


def memcpy(nbytes: int, tensors: int, iterations: int, warmups: int, check: bool, *, threads: int = 1) -> dict:
    """memcpy of the value into buffers of the same shapes: numpy ``copyto`` on one thread, or
    split over ``threads`` (tensorwire's own parallel copy, as shm's reads use that many).
    With ``check``, consecutive iterations copy different data (two seeds, alternating) into
    buffers zeroed before each (outside the timing)."""
    from tensorwire.transport.packing import parallel_copy

    seeds = (0, 1) if check else (0,)
    sources = {}
    for seed in seeds:
        value = make_value(nbytes, tensors, seed)
        sources[seed] = value if isinstance(value, list) else [value]
    targets = [torch.zeros_like(t) for t in sources[0]]
    times, wrong = [], 0
    for i in range(warmups + iterations):
        seed = seeds[i % len(seeds)]
        pairs = [(t.numpy(), s.numpy()) for t, s in zip(targets, sources[seed], strict=True)]
        if check:
            _zero(targets)
        start = time.perf_counter()
        for target, src in pairs:
            if threads > 1:
                parallel_copy(target.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8), threads)
            else:
                np.copyto(target, src)
        if i >= warmups:
            times.append(time.perf_counter() - start)
            value = targets if tensors > 1 else targets[0]
            if check and not matches(value, nbytes, tensors, seed):
                wrong += 1
    return {"times": times, "wrong": wrong if check else -1}


_OPS = {
    f.__name__: f
    for f in (
        hold,
        tw_fetch,
        ucx_start,
        ucx_connect,
        ucx_fetch,
        ucx_stop,
        gloo_join,
        gloo_fetch,
        gloo_stop,
        nixl_start,
        nixl_fetch,
        nixl_stop,
        memcpy,
    )
}


def dispatch(operation: str, *args: Any) -> Any:
    """Peer side: run ``operation`` (a function of this module) with ``args``."""
    if operation not in _OPS:
        raise ValueError(f"unknown benchmark operation {operation!r}")
    return _OPS[operation](*args)
