"""The process scenarios of ``tensorwire bench`` (``p2p-processes``, ``many-tensors``,
``concurrent``, with the ``nixl-compare`` rows from :mod:`.nixl_compare`): this process and
spawned peers, one of which claims another node, with their baselines (memcpy, bare
torch.distributed gloo, bare ucxx, bare NIXL) in the same run. :mod:`.runner` documents what is
interleaved and what ``--check`` checks."""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Any

from tensorwire.bench import ops
from tensorwire.bench.options import Options
from tensorwire.bench.schema import Row, make_row
from tensorwire.progress import ProgressBar
from tensorwire.transport.packing import COPY_THREADS

__all__ = ["MANY_TENSORS", "process_scenarios"]

MANY_TENSORS = (1, 16, 256, 1024)
_PEER_TIMEOUT_S = 600.0


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
    from tensorwire.runtime.agent import agent as runtime_agent
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
        if not (caps.same_node or caps.cross_node):
            notes.append(f"{name}: same process only, nothing to measure between processes")
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
    from tensorwire.bench.bare_nixl import nixl_api

    try:
        nixl_api()
    except ImportError as e:
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


def process_scenarios(options: Options, progress: ProgressBar, notes: list[str]) -> list[Row]:
    import tensorwire as tw
    from tensorwire.peers import spawn
    from tensorwire.runtime.agent import agent as runtime_agent
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
            return _ask(
                conn,
                "tw_fetch",
                ref,
                transport,
                device,
                nbytes,
                tensors,
                options.iterations,
                options.warmups,
                options.check,
            )

        if "p2p-processes" in options.scenarios:
            for nbytes in sizes:
                memcpy = ops.memcpy(nbytes, 1, options.iterations, options.warmups, options.check)
                rows.append(
                    make_row(
                        "p2p-processes",
                        "memcpy (one thread)",
                        memcpy,
                        baseline=True,
                        nbytes=nbytes,
                        reason="single-thread numpy copy in one process: the one-node bound",
                    )
                )
                if COPY_THREADS > 1:  # the bound for reads that use that many threads (shm's)
                    threaded = ops.memcpy(
                        nbytes, 1, options.iterations, options.warmups, options.check, threads=COPY_THREADS
                    )
                    rows.append(
                        make_row(
                            "p2p-processes",
                            f"memcpy ({COPY_THREADS} threads)",
                            threaded,
                            baseline=True,
                            nbytes=nbytes,
                            reason="numpy copy split over the threads shm's reads use: their bound",
                        )
                    )
                progress.step(f"memcpy {nbytes}")
                host_ref = tw.put(_value(nbytes, 1, cuda=False))
                plans = [
                    ("tensorwire auto (same node)", same, "", host_ref, None),
                    ("tensorwire auto (other node)", other, "", host_ref, None),
                ]
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
                    rows.append(
                        make_row(
                            "p2p-processes",
                            method,
                            result,
                            baseline=False,
                            nbytes=nbytes,
                            transport=result["transport"],
                            reason=reason,
                        )
                    )
                    progress.step(f"{method} {nbytes}")
                del host_ref, cuda_ref
            for kind in ("gloo", "ucxx"):
                label = "bare torch.distributed gloo" if kind == "gloo" else "bare ucxx"
                for nbytes, result in _bare_pair(kind, other, sizes, options, notes).items():
                    rows.append(
                        make_row(
                            "p2p-processes",
                            label,
                            result,
                            baseline=True,
                            nbytes=nbytes,
                            transport=kind,
                            reason="ask, then send, on a connected pair",
                        )
                    )
                progress.step(label)
            for nbytes, result in _bare_nixl(other, sizes, options, notes).items():
                rows.append(
                    make_row(
                        "p2p-processes",
                        "bare NIXL",
                        result,
                        baseline=True,
                        nbytes=nbytes,
                        transport="nixl",
                        reason="one-sided READ of a registered buffer",
                    )
                )
            progress.step("bare NIXL")

        largest = sizes[-1]
        if "many-tensors" in options.scenarios:
            for tensors in MANY_TENSORS:
                ref = tw.put(_value(largest, tensors, cuda=False))
                for method, conn in (("tensorwire auto (same node)", same), ("tensorwire auto (other node)", other)):
                    result = fetch(conn, ref, "", largest, tensors)
                    rows.append(
                        make_row(
                            "many-tensors",
                            method,
                            result,
                            baseline=False,
                            nbytes=largest,
                            tensors=tensors,
                            transport=result["transport"],
                            reason=result["reason"],
                        )
                    )
                del ref
                memcpy = ops.memcpy(largest, tensors, options.iterations, options.warmups, options.check)
                rows.append(
                    make_row(
                        "many-tensors",
                        "memcpy (one thread)",
                        memcpy,
                        baseline=True,
                        nbytes=largest,
                        tensors=tensors,
                        reason="tensor by tensor, one process",
                    )
                )
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
            merged = {
                "times": [t for r in results for t in r["times"]],
                "wrong": sum(r["wrong"] for r in results) if options.check else -1,
            }
            total = largest * options.iterations * len(readers)
            rows.append(
                make_row(
                    "concurrent",
                    f"tensorwire auto x{len(readers)} readers",
                    merged,
                    baseline=False,
                    nbytes=largest,
                    peers=len(readers),
                    transport=results[0]["transport"],
                    reason=results[0]["reason"],
                    operation="one_to_n",
                    rate=total / busy / 1e9 / len(readers),
                )
            )
            del ref
            memcpy = ops.memcpy(largest, 1, options.iterations, options.warmups, options.check)
            rows.append(
                make_row(
                    "concurrent",
                    "memcpy (one thread)",
                    memcpy,
                    baseline=True,
                    nbytes=largest,
                    peers=len(readers),
                    reason="one thread copying: the one-node bound",
                )
            )
            progress.step("concurrent")
    gc.collect()
    return rows


# ---------------------------------------------------------------------- Ray scenarios
