"""The Ray scenarios of the benchmark: actor to actor, and one actor to N.

Every method moves the same value between the same kind of actors, and the receiving actor
copies it into buffers it keeps (what loading weights does), so the rows compare like with
like. A round is timed from the caller: start the producer's call, hand its result to the
consumer(s), wait for them.

The methods of one size are interleaved: after each method's warm-up rounds, round ``r`` of
every method runs before round ``r + 1`` of any (in rotating order), so load on the machine
falls on all of them alike. With ``--check``, before every timed round (outside the timing)
the producer re-patterns its value with a seed of that round and the consumers zero their
buffers; after it, every consumer's buffers are compared with that round's pattern, so a round
that delivers nothing, or delivers an earlier round's data, counts as wrong. Ray RDT over NIXL
runs last, on actors of its own (:func:`_ray_nixl`: its actors keep a core busy each).
"""

from __future__ import annotations

import functools
import importlib.util
import time
from typing import Any

import torch

import tensorwire as tw
from tensorwire.bench import ops, ray_baselines
from tensorwire.bench.schema import make_row
from tensorwire.runtime.ray import calls

__all__ = ["run"]

_ZERO_COPY = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}}
_TIMEOUT_S = 600.0


def _gather(refs: list[Any]) -> list[Any]:
    return calls.gather(refs, timeout_s=_TIMEOUT_S)


class _Node:
    """Producer and consumer at once: ``value`` to send, ``buffers`` it copies into."""

    def __init__(self) -> None:
        self.value: Any = None
        self.buffers: dict[str, torch.Tensor] = {}

    def set(self, nbytes: int, tensors: int, device: str = "cpu") -> None:
        value = ops.make_value(nbytes, tensors)
        values = value if isinstance(value, list) else [value]
        self.value = {f"t{i}": t.to(device) for i, t in enumerate(values)}
        self.buffers = {name: torch.zeros_like(t) for name, t in self.value.items()}

    def repattern(self, nbytes: int, tensors: int, seed: int) -> None:
        """Give the value (in place) the pattern of ``seed``: each checked round sends new data."""
        value = ops.make_value(nbytes, tensors, seed)
        for tensor, fresh in zip(self.value.values(), value if isinstance(value, list) else [value], strict=True):
            tensor.copy_(fresh)

    def take(self, value: dict[str, torch.Tensor]) -> int:
        for name, buffer in self.buffers.items():
            buffer.copy_(value[name])
        return len(value)

    def clear(self) -> None:
        for buffer in self.buffers.values():
            buffer.zero_()

    def verify(self, nbytes: int, tensors: int, seed: int = 0) -> bool:
        values = list(self.buffers.values())
        return ops.matches(values[0] if tensors == 1 else values, nbytes, tensors, seed)

    # one-to-N baselines
    def put_state(self) -> list:
        return ray_baselines.put(self.value)

    def load_from_store(self, boxed: list) -> int:
        return self.take(ray_baselines.take(boxed))

    receives = True  # False in the one that broadcasts

    def be_source(self) -> None:
        self.receives = False

    def broadcast_all(self, group: str) -> int:
        tensors = self.buffers if self.receives else self.value
        g = tw.collective.get_group(group)
        for tensor in tensors.values():
            g.broadcast(tensor, 0)
        return len(tensors)


@tw.remote(num_cpus=0)
class TwNode(_Node):
    @tw.method
    def value_ref(self) -> dict[str, torch.Tensor]:
        return self.value


class _RayNode(_Node):
    def value_plain(self) -> dict[str, torch.Tensor]:
        return self.value


def _value(self: _Node) -> dict[str, torch.Tensor]:
    return self.value


_ray_node: list[Any] = []


def ray_node() -> Any:
    """The plain Ray actor class of the baselines (made once, when first needed): ``value_plain``
    through the object store, ``value_rdt*`` through Ray's direct transport."""
    if not _ray_node:
        # GPU variants (unverified: written for machines with GPUs and Ray; none was available)
        methods = {
            "value_rdt": (_value, "gloo"),
            "value_rdt_nccl": (_value, "nccl"),
            "value_rdt_cuda_ipc": (_value, "cuda_ipc"),
            "value_rdt_nixl": (_value, "nixl"),
            "value_rdt_tensorwire": (_value, "tensorwire"),  # tensorwire as Ray's registered transport
        }
        _ray_node.append(ray_baselines.rdt_actor_class(_RayNode, methods, num_cpus=0))
    return _ray_node[0]


def _hand_over(source: Any, consumer: Any, method: str) -> None:
    """One round: call ``source.method``, pass its result to ``consumer.take``, wait."""
    _gather([consumer.take.remote(getattr(source, method).remote())])


class _Plan:
    """One method of a comparison: ``fn()`` is a round; ``source`` sends, ``consumers`` receive."""

    def __init__(self, fn: Any, source: Any, consumers: list[Any], baseline: bool) -> None:
        self.fn, self.source, self.consumers, self.baseline = fn, source, consumers, baseline
        self.times: list[float] = []
        self.wrong = 0

    def prepare(self, nbytes: int, tensors: int, seed: int) -> None:
        _gather([self.source.repattern.remote(nbytes, tensors, seed), *(c.clear.remote() for c in self.consumers)])

    def verify(self, nbytes: int, tensors: int, seed: int) -> bool:
        return all(_gather([c.verify.remote(nbytes, tensors, seed) for c in self.consumers]))


def _interleaved(plans: dict[str, _Plan], nbytes: int, tensors: int, options: Any) -> dict[str, dict]:
    """Warm-ups per method, then the timed rounds interleaved across methods in rotating
    order; with ``options.check``, re-pattern and clear before each timed round and verify
    after it (see the module docstring). {method: {"times", "wrong"}}."""
    for plan in plans.values():
        for _ in range(options.warmups):
            plan.fn()
    order = list(plans.values())
    for r in range(options.iterations):
        for k in range(len(order)):
            plan = order[(r + k) % len(order)]
            seed = r + 1  # round 0 of the warm-ups used seed 0
            if options.check:
                plan.prepare(nbytes, tensors, seed)
            start = time.perf_counter()
            plan.fn()
            plan.times.append(time.perf_counter() - start)
            if options.check and not plan.verify(nbytes, tensors, seed):
                plan.wrong += 1
    return {m: {"times": p.times, "wrong": p.wrong if options.check else -1} for m, p in plans.items()}


def _measure(
    scenario: str,
    plans: dict[str, _Plan],
    nbytes: int,
    options: Any,
    *,
    reason: str,
    progress: Any = None,
    tensors: int = 1,
) -> list[Any]:
    """A row per method, measured interleaved (:func:`_interleaved`)."""
    rows = []
    for method, result in _interleaved(plans, nbytes, tensors, options).items():
        baseline = plans[method].baseline
        rows.append(
            make_row(
                scenario,
                method,
                result,
                baseline=baseline,
                nbytes=nbytes,
                tensors=tensors,
                transport="" if baseline else "auto",
                reason=reason,
            )
        )
        if progress is not None:
            progress.step(f"actors {method} {nbytes}")
    return rows


def run(options: Any, progress: Any, notes: list[str]) -> list[Any]:
    started_ray = not calls.is_initialized()
    # a local instance of its own (its own CPU count), even when another cluster runs on this machine
    tw.init(address="local", include_dashboard=False, num_cpus=max(4, options.peers + 2))
    rows = []
    try:
        if "p2p-actors" in options.scenarios:
            rows += _p2p(options, progress, notes)
            rows += _p2p_gpu(options, notes)
        if "one-to-n" in options.scenarios:
            rows += _one_to_n(options, progress)
    finally:
        if started_ray:
            calls.shutdown()
    return rows


def _p2p(options: Any, progress: Any, notes: list[str]) -> list[Any]:
    node = ray_node()
    tw_src, tw_dst = TwNode.remote(), TwNode.remote()
    ray_src, ray_dst = node.remote(), node.remote()
    zc_src, zc_dst = node.options(runtime_env=_ZERO_COPY).remote(), node.options(runtime_env=_ZERO_COPY).remote()
    rdt = True
    try:
        ray_baselines.create_rdt_group([ray_src, ray_dst], backend="torch_gloo")
    except Exception as e:  # noqa: BLE001 - reported, the rest still runs
        rdt = False
        notes.append(f"Ray direct transport: could not make its gloo group ({e})")
    nixl_rdt = importlib.util.find_spec("nixl") is not None
    if not nixl_rdt:
        notes.append("Ray RDT over nixl (CPU tensors): the nixl package is not installed (pip install nixl)")
    rows = []
    for nbytes, tensors in _p2p_cases(options.sizes):
        nodes = [tw_src, tw_dst, ray_src, ray_dst, zc_src, zc_dst]
        _gather([n.set.remote(nbytes, tensors) for n in nodes])
        plans = {
            "tensorwire (@tw.method ref)": _Plan(
                functools.partial(_hand_over, tw_src, tw_dst, "value_ref"), tw_src, [tw_dst], False
            ),
            "tensorwire (ray.method tensor_transport)": _Plan(
                functools.partial(_hand_over, ray_src, ray_dst, "value_rdt_tensorwire"), ray_src, [ray_dst], False
            ),
            "Ray object store": _Plan(
                functools.partial(_hand_over, ray_src, ray_dst, "value_plain"), ray_src, [ray_dst], True
            ),
            "Ray object store, zero-copy torch": _Plan(
                functools.partial(_hand_over, zc_src, zc_dst, "value_plain"), zc_src, [zc_dst], True
            ),
        }
        if rdt:
            plans["Ray RDT (gloo)"] = _Plan(
                functools.partial(_hand_over, ray_src, ray_dst, "value_rdt"), ray_src, [ray_dst], True
            )
        rows += _measure(
            "p2p-actors", plans, nbytes, options, reason=_reason(tensors), progress=progress, tensors=tensors
        )
    if nixl_rdt:  # Ray's NIXL transport reads CPU tensors too (it imports nixl._api)
        rows += _ray_nixl(node, options, progress)
    return rows


def _reason(tensors: int) -> str:
    return "actor -> actor, the consumer copies it in" + (f" ({tensors} tensors)" if tensors > 1 else "")


def _ray_nixl(node: Any, options: Any, progress: Any) -> list[Any]:
    """Ray RDT over NIXL, on a pair of actors of its own, after every other method. Ray makes
    its NIXL agent with NIXL's default progress thread, which polls without a pause: once the
    pair has connected, each of the two actors keeps a core busy for as long as it lives
    (measured on the 2-core VM: after a few such rounds, tensorwire's 64 MiB round between two
    other actors took 42 ms instead of 22, and every part of it twice as long). Interleaved, it
    would slow every method measured beside it; the pair goes when its rounds are done."""
    pair: list[Any] = []
    rows = []
    try:
        for _ in range(2):
            pair.append(node.remote())  # listed one by one: one made before a failure goes too
        src, dst = pair
        for nbytes, tensors in _p2p_cases(options.sizes):
            _gather([n.set.remote(nbytes, tensors) for n in (src, dst)])
            plan = _Plan(functools.partial(_hand_over, src, dst, "value_rdt_nixl"), src, [dst], True)
            rows += _measure(
                "p2p-actors",
                {"Ray RDT (nixl)": plan},
                nbytes,
                options,
                reason=_reason(tensors) + "; measured after the others, on actors of its own",
                progress=progress,
                tensors=tensors,
            )
    finally:
        for actor in pair:
            ray_baselines.kill(actor)
    return rows


STATE_DICT_TENSORS = 1024


def _p2p_cases(sizes: list[int]) -> list[tuple[int, int]]:
    """(bytes, tensors): every size as one tensor, and the largest size of at least 1 MiB
    again as a state dict of :data:`STATE_DICT_TENSORS` tensors."""
    cases = [(nbytes, 1) for nbytes in sizes]
    large = [nbytes for nbytes in sizes if nbytes >= 1 << 20]
    if large:
        cases.append((max(large), STATE_DICT_TENSORS))
    return cases


def _gpu_plans(notes: list[str]) -> list[tuple[str, str, float, str]]:
    """(RDT transport, its method, GPUs per actor, collective backend or "") that fit here."""
    import importlib.util

    gpus = ray_baselines.cluster_gpus()
    if gpus < 1:
        notes.append("GPU actor baselines (Ray RDT over nccl / cuda_ipc / nixl): no GPU in the Ray cluster")
        return []
    plans = [("cuda_ipc", "value_rdt_cuda_ipc", 0.5, "")]
    if gpus >= 2:
        plans.append(("nccl", "value_rdt_nccl", 1.0, "nccl"))
        if importlib.util.find_spec("nixl") is not None:
            plans.append(("nixl", "value_rdt_nixl", 1.0, ""))
        else:
            notes.append("Ray RDT over nixl: the nixl package is not installed")
    else:
        notes.append("Ray RDT over nccl / nixl: needs two GPUs")
    return plans


def _p2p_gpu(options: Any, notes: list[str]) -> list[Any]:
    """GPU tensors actor to actor: tensorwire against Ray's direct transport over each GPU
    transport that fits the cluster. Unverified: no GPU machine with Ray was available."""
    node = ray_node()
    rows = []
    for rdt, method_name, gpus, backend in _gpu_plans(notes):
        tw_src, tw_dst = TwNode.options(num_gpus=gpus).remote(), TwNode.options(num_gpus=gpus).remote()
        ray_src, ray_dst = node.options(num_gpus=gpus).remote(), node.options(num_gpus=gpus).remote()
        if backend:
            ray_baselines.create_rdt_group([ray_src, ray_dst], backend=backend)
        for nbytes in options.sizes:
            _gather([n.set.remote(nbytes, 1, "cuda") for n in (tw_src, tw_dst, ray_src, ray_dst)])
            plans = {
                f"tensorwire GPU ({rdt} placement)": _Plan(
                    functools.partial(_hand_over, tw_src, tw_dst, "value_ref"), tw_src, [tw_dst], False
                ),
                f"Ray RDT ({rdt})": _Plan(
                    functools.partial(_hand_over, ray_src, ray_dst, method_name), ray_src, [ray_dst], True
                ),
            }
            rows += _measure(
                f"p2p-actors-gpu-{rdt}", plans, nbytes, options, reason="GPU actor -> GPU actor, unverified path"
            )
        for actor in (tw_src, tw_dst, ray_src, ray_dst):
            ray_baselines.kill(actor)
    return rows


def _one_to_n(options: Any, progress: Any) -> list[Any]:
    n = max(1, options.peers)
    source = TwNode.remote()
    receivers = [TwNode.remote() for _ in range(n)]
    everyone = [source, *receivers]
    _gather([source.be_source.remote()])
    tw.collective.create_group(everyone, backend="gloo", name="tw-bench")
    rows = []
    try:
        for nbytes in options.sizes:
            tensors = 8 if nbytes >= 8 * 4096 else 1
            _gather([a.set.remote(nbytes, tensors) for a in everyone])
            sync = tw.WeightSync(source, receivers, source="value", target="buffers", progress=False)

            def store() -> None:
                (boxed,) = _gather([source.put_state.remote()])
                _gather([r.load_from_store.remote(boxed) for r in receivers])

            plans = {
                "tensorwire WeightSync": _Plan(lambda s=sync: _ok(s.push()), source, receivers, False),
                "Ray object store (put once, N gets)": _Plan(store, source, receivers, True),
                "torch.distributed gloo broadcast": _Plan(
                    lambda: _gather([a.broadcast_all.remote("tw-bench") for a in everyone]), source, receivers, True
                ),
            }
            for method, result in _interleaved(plans, nbytes, tensors, options).items():
                baseline = plans[method].baseline
                rows.append(
                    make_row(
                        "one-to-n",
                        method,
                        result,
                        baseline=baseline,
                        nbytes=nbytes,
                        tensors=tensors,
                        peers=n,
                        operation="one_to_n",
                        transport="" if baseline else "auto",
                        reason=f"1 -> {n} actors, into their tensors",
                    )
                )
                progress.step(f"one-to-n {method} {nbytes}")
            sync.close()
    finally:
        tw.collective.destroy_group("tw-bench")
    return rows


def _ok(report: Any) -> None:
    if not report.ok:
        raise RuntimeError(f"weight sync failed: {report.failed}")
