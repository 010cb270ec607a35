"""Actors of the collective and weight-sync tests."""

from __future__ import annotations

import os
import signal
import threading
import time
import zlib

import torch

import tensorwire as tw


def member_input(rank: int, shape: tuple[int, ...] = (6, 5), dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Rank ``rank``'s input: small integers, so sums and products are exact in any order."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(-4, 5, shape, generator=gen).to(dtype)


@tw.remote(num_cpus=0)
class Member:
    """A member that runs one collective of a group on its ``member_input`` and returns the result."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def pid(self) -> int:
        return os.getpid()

    def groups(self) -> list[str]:
        return tw.collective.group_names()

    def run(self, name: str, op: str, **kwargs):
        group = tw.collective.get_group(name)
        world = group.world_size
        mine = member_input(self.rank)
        if op == "broadcast":
            group.broadcast(mine, kwargs["src"])
            return mine
        if op == "broadcast_transposed":  # a non-contiguous tensor, changed in place
            view = mine.t()
            group.broadcast(view, kwargs["src"])
            return view
        if op == "all_reduce":
            group.all_reduce(mine, op=kwargs.get("reduce", "sum"))
            return mine
        if op == "all_gather":
            out = [torch.empty_like(mine) for _ in range(world)]
            group.all_gather(out, mine)
            return out
        if op == "reduce_scatter":
            inputs = [member_input(self.rank * world + r) for r in range(world)]
            out = torch.empty_like(inputs[0])
            group.reduce_scatter(out, inputs, op=kwargs.get("reduce", "sum"))
            return out
        if op == "barrier":
            time.sleep(0.3 * self.rank)
            group.barrier()
            return time.time()
        if op == "send":
            group.send(mine * 10, kwargs["dst"], tag=kwargs.get("tag", 0))
            return None
        if op == "recv":
            out = torch.zeros_like(mine)
            group.recv(out, kwargs["src"], tag=kwargs.get("tag", 0))
            return out
        raise ValueError(op)

    def run_catching(self, name: str, op: str, **kwargs):
        start = time.monotonic()
        try:
            self.run(name, op, **kwargs)
        except Exception as e:
            return type(e).__name__, str(e), time.monotonic() - start
        return None, "", time.monotonic() - start


def digests(actors) -> list[str]:
    """Each actor's ``digest()`` (its tensors' checksum), in order."""
    import ray

    return ray.get([a.digest.remote() for a in actors])


def die_at(role: str, k: int) -> None:
    """In a weight-sync member: SIGKILL this process once it has handled bucket level ``k``
    of a push as ``role`` ("trainer" or "receiver")."""

    def hook(at_role: str, at_k: int) -> None:
        if (at_role, at_k) == (role, k):
            os.kill(os.getpid(), signal.SIGKILL)

    tw.collective.set_fault_point(hook)


def die_in_second_send() -> None:
    """In a weight-sync trainer: SIGKILL this process when it starts serving a second time in
    one push (a cover's send, beside the try's: :mod:`tensorwire.collectives.weight_sync.recovery.cover`)."""
    starts = []

    def hook(at_role: str, at_k: int) -> None:
        if (at_role, at_k) == ("trainer", -1):
            starts.append(at_k)
            if len(starts) == 2:
                os.kill(os.getpid(), signal.SIGKILL)

    tw.collective.set_fault_point(hook)


def stall_at(role: str, k: int) -> None:
    """In a weight-sync member: block (alive, sending nothing) once it has handled bucket level
    ``k`` of a push as ``role``, until the process is killed (at most ten minutes)."""

    def hook(at_role: str, at_k: int) -> None:
        if (at_role, at_k) == (role, k):
            threading.Event().wait(600)

    tw.collective.set_fault_point(hook)


def stop_at(role: str, k: int) -> None:
    """In a weight-sync member: stop this whole process with ``SIGSTOP`` (as a debugger, a
    swapped-out host or a hung collective would: nothing of it runs, its control service
    included) once it has handled bucket level ``k`` of a push as ``role`` (-1: before the
    first); ``SIGCONT`` from outside resumes it."""

    def hook(at_role: str, at_k: int) -> None:
        if (at_role, at_k) == (role, k):
            os.kill(os.getpid(), signal.SIGSTOP)

    tw.collective.set_fault_point(hook)


def fail_at(role: str, k: int) -> None:
    """In a weight-sync member: raise once it has handled bucket level ``k`` of a push as ``role``."""

    def hook(at_role: str, at_k: int) -> None:
        if (at_role, at_k) == (role, k):
            raise RuntimeError(f"injected failure at {role} bucket {k}")

    tw.collective.set_fault_point(hook)


def fail_once_a_receiver_wrote(k: int, flag: str) -> None:
    """In a trainer: raise once it has handled bucket level ``k`` of a push and a receiver has
    taken bucket level 0 in (the file ``flag`` exists: :func:`mark_written`; waited for at most
    60 s): a failure after the receivers began to write, however fast the machine is."""

    def hook(at_role: str, at_k: int) -> None:
        if (at_role, at_k) == ("trainer", k):
            deadline = time.monotonic() + 60
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.01)
            raise RuntimeError(f"injected failure at trainer bucket {k}")

    tw.collective.set_fault_point(hook)


def mark_written(flag: str) -> None:
    """In a receiver: make the file ``flag`` once it has taken bucket level 0 of a push in."""

    def hook(at_role: str, at_k: int) -> None:
        if (at_role, at_k) == ("receiver", 0):
            with open(flag, "a"):
                pass

    tw.collective.set_fault_point(hook)


def note_commit(actor: Holder, version: int) -> None:
    """An ``on_commit`` function: ``f(actor, version)``."""
    actor.commits.append(("function", version))


@tw.remote(num_cpus=0)
class Holder:
    """Trainer or receiver of weight-sync tests: a dict of tensors (``weights``)."""

    def __init__(self, num_tensors: int, total_nbytes: int, seed: int | None) -> None:
        per = max(1, total_nbytes // num_tensors // 4)
        gen = torch.Generator().manual_seed(seed or 0)
        make = (lambda: torch.randn(per, generator=gen)) if seed is not None else (lambda: torch.zeros(per))
        self.weights = {f"layer{i}.weight": make() for i in range(num_tensors)}
        self.commits: list[tuple[str, int]] = []  # what on_commit saw

    def pid(self) -> int:
        return os.getpid()

    def sizes(self) -> list[int]:
        return [t.numel() * t.element_size() for t in self.weights.values()]

    def die_at(self, role: str, k: int) -> None:
        die_at(role, k)

    def die_in_second_send(self) -> None:
        die_in_second_send()

    def stop_at(self, role: str, k: int) -> None:
        stop_at(role, k)

    def stall_at(self, role: str, k: int) -> None:
        stall_at(role, k)

    def fail_at(self, role: str, k: int) -> None:
        fail_at(role, k)

    def no_faults(self) -> None:
        tw.collective.set_fault_point(None)

    def fail_once_a_receiver_wrote(self, k: int, flag: str) -> None:
        fail_once_a_receiver_wrote(k, flag)

    def mark_written(self, flag: str) -> None:
        mark_written(flag)

    def note_commit(self, version: int) -> None:
        """An ``on_commit`` method."""
        self.commits.append(("method", version))

    def commits_seen(self) -> list[tuple[str, int]]:
        return list(self.commits)

    def data_ptrs(self) -> list[int]:
        return [t.data_ptr() for t in self.weights.values()]

    def digest(self) -> str:
        from tests.helpers.tasks import digest

        return digest(self.weights)

    def digests_by_name(self) -> dict[str, str]:
        from tests.helpers.tasks import digest

        return {name: digest([t]) for name, t in self.weights.items()}

    def step(self, seed: int) -> None:
        """Change every weight in place, like an optimizer step."""
        gen = torch.Generator().manual_seed(seed)
        for tensor in self.weights.values():
            tensor.add_(torch.randn(tensor.shape, generator=gen))

    def block_until(self, path: str, timeout_s: float = 120.0) -> bool:
        """Keep this actor busy (its calls wait behind this one) until ``path`` exists; whether it did."""
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def change_one(self, name: str, value: float) -> None:
        """Change one weight in place (the others stay as they are)."""
        self.weights[name].fill_(value)

    def reshape_first(self) -> None:
        """Break the layout the sync was made with."""
        self.weights["layer0.weight"] = torch.zeros(3)

    def version(self, name: str = "weights") -> int:
        return tw.collective.weight_version(name)

    def watch_fence_at(self, k: int, name: str = "weights") -> None:
        """Note, at bucket level ``k`` of each push it receives, whether the fence is held."""

        def hook(role: str, at: int) -> None:
            if (role, at) == ("receiver", k):
                self.fence_seen.append(tw.collective.weight_fence(name).locked())

        self.fence_seen: list[bool] = []
        tw.collective.set_fault_point(hook)

    def fence_held(self, name: str = "weights") -> list[bool]:
        """What ``watch_fence_at`` saw, then whether the fence is held now."""
        return [*getattr(self, "fence_seen", []), tw.collective.weight_fence(name).locked()]

    def aside_nbytes(self, sync_id: str) -> int:
        """Bytes this receiver keeps aside for sync ``sync_id`` (shadows, float8 staging)."""
        from tensorwire.collectives.weight_sync.commit import aside

        return aside.aside_nbytes(sync_id)

    def own_fence_free(self) -> bool:
        return not self.own.locked()

    def own_fence(self, have: bool) -> None:
        """Give this receiver a fence attribute (``own``), or take it away."""
        if have:
            self.own = threading.Lock()
        elif hasattr(self, "own"):
            del self.own


class CountingFence:
    """A receiver-supplied fence (any context manager) that counts how often it was taken."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.entries = 0

    def __enter__(self) -> None:
        self.lock.acquire()
        self.entries += 1

    def __exit__(self, *_exc: object) -> None:
        self.lock.release()


def doubled(_name: str, piece: torch.Tensor) -> torch.Tensor:
    """A trainer transform: every value times two."""
    return piece * 2


def full_tensor(name: str, shape: tuple[int, ...], version: int = 1) -> torch.Tensor:
    """The whole parameter ``name`` at ``version`` (what every test computes its expectations from)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{version}".encode()))
    return torch.randn(shape, generator=gen)


@tw.remote(num_cpus=0)
class Pieces:
    """A trainer or receiver of sharded weight-sync tests.

    ``entries``: name -> (global shape, placements, mesh shape, coordinate, dtype, local shape
    or None). Trainers (``version`` > 0) hold their piece of ``full_tensor(name, shape,
    version)``; receivers (``version`` == 0) zeros of their local shape.
    """

    def __init__(self, entries: dict, version: int = 0) -> None:
        from tensorwire.collectives.weight_sync.planning.layout import placement_box

        self.entries = entries
        self.pieces = {}
        for name, (shape, placements, mesh, coord, dtype, local) in entries.items():
            box = placement_box(shape, placements, mesh, coord)
            if version:
                tensor = full_tensor(name, shape, version)[box.slices()].to(getattr(torch, dtype)).contiguous()
            else:
                tensor = torch.zeros(local or box.sizes, dtype=getattr(torch, dtype))
            self.pieces[name] = tw.collective.Sharded.of(tensor, placements, mesh, coord, shape)
        self.readings = {"reads": 0, "mixed": [], "versions": set()}
        self._stop = None
        self.publish_fence = CountingFence()

    def fence_entries(self) -> int:
        return self.publish_fence.entries

    def state_dict(self) -> dict:
        return self.pieces

    def pid(self) -> int:
        return os.getpid()

    def tensors(self) -> dict[str, torch.Tensor]:
        """Copies of the pieces (float8 ones as their bytes: Ray cannot pickle float8)."""
        result = {}
        for name, piece in self.pieces.items():
            tensor = piece.tensor
            result[name] = (
                tensor.view(torch.uint8) if tensor.dtype.itemsize == 1 and tensor.is_floating_point() else tensor
            ).clone()
        return result

    def data_ptrs(self) -> list[int]:
        return [piece.tensor.data_ptr() for piece in self.pieces.values()]

    def die_at(self, role: str, k: int) -> None:
        die_at(role, k)

    def become(self, version: int) -> None:
        """A training step: every piece becomes its part of ``full_tensor(..., version)``, in place."""
        from tensorwire.collectives.weight_sync.planning.layout import placement_box

        for name, (shape, placements, mesh, coord, _dtype, _local) in self.entries.items():
            box = placement_box(shape, placements, mesh, coord)
            self.pieces[name].tensor.copy_(full_tensor(name, shape, version)[box.slices()])

    def fill(self, value: float) -> None:
        for piece in self.pieces.values():
            piece.tensor.fill_(value)

    def start_reader(self) -> None:
        """A thread that takes the sync's fence over and over and checks that every tensor holds
        one value, the version it reports (the trainers push constant tensors)."""
        import threading

        self._stop = threading.Event()

        def run() -> None:
            fence = tw.collective.weight_fence("weights")
            while not self._stop.is_set():
                with fence:
                    version = tw.collective.weight_version("weights")
                    values = set()
                    for piece in self.pieces.values():
                        flat = piece.tensor.reshape(-1)
                        values.update((float(flat[0]), float(flat[flat.numel() // 2]), float(flat[-1])))
                self.readings["reads"] += 1
                self.readings["versions"].add(version)
                if values != {float(version)}:
                    self.readings["mixed"].append((version, sorted(values)[:4]))
                time.sleep(0.0002)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop_reader(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=30)
        return {**self.readings, "versions": sorted(self.readings["versions"])}

    def version(self, name: str = "weights") -> int:
        return tw.collective.weight_version(name)


@tw.remote(num_cpus=0)
class DTensorTrainer:
    """A trainer rank whose ``state_dict()`` gives DTensors (gloo, a 1-D mesh of ``world`` ranks)."""

    def __init__(self, rank: int, world: int, port: int, shapes: dict, placements: dict) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard

        from tensorwire.collectives.weight_sync.planning.layout import placement_box

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        self.state = {}
        for name, shape in shapes.items():
            ours = placements[name]
            theirs = [Shard(p.dim) if isinstance(p, tw.collective.Shard) else Replicate() for p in ours]
            box = placement_box(shape, ours, (world,), (rank,))
            local = full_tensor(name, shape)[box.slices()].contiguous()
            self.state[name] = DTensor.from_local(
                local, mesh, theirs, run_check=False, shape=shape, stride=full_tensor(name, shape).stride()
            )

    def state_dict(self) -> dict:
        return self.state
