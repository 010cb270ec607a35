"""``tw.WeightSync``: push M trainers' weights into N receivers' tensors along a plan.

::

    sync = tw.WeightSync(trainers, receivers)     # actors made with @tw.remote; plan computed here
    print(sync.plan)                              # bytes per trainer -> receiver pair, totals
    report = sync.push()                          # every receiver now holds version 1
    sync.close()                                  # frees the staging memory

Each actor describes its pieces of every parameter (:mod:`.layout`: plain tensors are whole,
DTensors and ``tw.collective.Sharded`` say which piece they are); the driver computes the plan
once (:mod:`.plan`: renames, fused parameters, dtype conversion, load spread over trainers that
hold the same piece) and each push moves exactly the plan's bytes, all pairs at once, in
buckets of about ``bucket_bytes`` with at most two buckets staged per stream (:mod:`.fanout`;
actors' side in :mod:`.sync_hooks`). One trainer into identical receivers is the M = 1 case.

Versions: ``push()`` publishes the next version on every receiver or on none (``commit="all"``,
the default): each receiver assembles it in a shadow copy (one copy of its parameters, kept
across pushes), tells the driver, and publishes it with one local copy inside a fence (``fence=``
names an attribute of the receiver giving a lock or context manager; default
``tw.collective.weight_fence(name)``) once the driver saw every receiver ready; on any failure
every receiver keeps the version it had, bit for bit (:mod:`.commit`). ``commit="each"``: each
receiver commits on its own, in place (no shadow) unless ``atomic=True`` (a shadow, published
inside the fence). ``aside="none"`` (every byte held by two trainers): all-or-none with no
shadow, receivers voting before they write in place inside their fence (:mod:`.fence_hold`).
``on_commit`` runs in a receiver once per version it commits; ``wait_version(v)`` waits in the
driver until every receiver holds ``v``.

Membership: ``add_receiver`` / ``remove_receiver`` between pushes. A receiver that dies mid-push
is dropped (``report.failed``); a trainer that fails fails the push; one that dies or stalls is
replaced when the others hold its bytes: the push reads what is missing from them (:mod:`.failover`).
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable, Sequence
from collections.abc import Mapping as MappingABC
from typing import Any

import torch

from tensorwire.collectives import failover, join, sync_hooks, sync_versions
from tensorwire.collectives.api import DEFAULT_TIMEOUT_S, check_actors, describe_actors
from tensorwire.collectives.commit import Vote
from tensorwire.collectives.failover import replan_without
from tensorwire.collectives.fanout import checksum
from tensorwire.collectives.layout import HeldParam
from tensorwire.collectives.plan import Fuse, Held, Mapping, Plan, bucket_plan
from tensorwire.collectives.push_specs import member_specs, two_sources
from tensorwire.collectives.push_wait import PushWait
from tensorwire.collectives.sync_hooks import ReceiveResult, Role, weight_version
from tensorwire.collectives.sync_report import SyncReport
from tensorwire.collectives.sync_telemetry import failover_pairs, pairs_of, record
from tensorwire.errors import TensorwireError
from tensorwire.runtime import calls
from tensorwire.runtime.actor import ActorHandle
from tensorwire.runtime.hooks import call_hook
from tensorwire.transport.config import validate_timeout

__all__ = ["SyncReport", "WeightSync", "bucket_plan", "checksum", "weight_version"]

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024


class WeightSync:
    """Push trainer actors' tensors into receiver actors' tensors (see the module doc).

    Args:
        trainers: The actor (or actors, each holding pieces) with the weights (``@tw.remote``).
        receivers: The actors to update.
        source: Attribute or method of the trainers giving an ``nn.Module`` or a dict of
            tensors, DTensors or ``Sharded`` pieces; default: their ``state_dict()`` method
            when they have one, else their ``model``.
        target: The same on the receivers (default: ``source``).
        rename: Trainer name -> receiver name (dict, or a function; None from it: not synced).
        fuse: Receiver name -> ``Fuse`` (or the trainer part names, fused along dim 0).
        scales: Receiver float8 parameter -> the receiver tensor that gets its per-tensor scale.
        transform: ``f(trainer name, piece) -> piece`` of the same shape, run on the trainer.
        atomic: Publish each version at once inside the receivers' fence (see the module doc).
        fence: Name of the receivers' attribute giving the fence (a lock or context manager).
        commit: ``"all"``: a version becomes every receiver's or none's (each assembles it aside,
            like ``atomic``, and commits when all have it; on any failure all keep the one they
            had); ``"each"``: every receiver commits on its own (in place unless ``atomic``).
        aside: Where an all-or-none version is assembled. ``"shadow"``: a copy of each
            receiver's parameters (kept between pushes; readers wait for one local copy).
            ``"none"``: in the receivers' tensors, inside their fence held from their vote
            (before the first write) until they publish: no memory aside (float8 staging
            apart), readers wait the whole push; needs every byte held by two trainers, so that
            a lost one is replaced (a push with one source for some bytes uses a shadow).
        on_commit: Run in a receiver once per version it commits: the name of its method
            (called with the version) or a function ``f(actor, version)``.
        bucket_bytes: Bucket size; extra memory is about two buckets per stream and relay.
        transport: "auto" (the selector, per receiver) or a transport name for every fetch.
        verify: Checksum every bucket and check it in the receivers.
        progress: Show a progress bar on stderr (default: when stderr is a terminal).
        name: Name of this sync, for ``weight_version(name)`` in the receivers.
        timeout_s: Deadline of each wait inside a push (setup included).
        stall_s: A trainer that sends a receiver no next bucket for this long stalled: it is
            replaced like a dead one (default: half of ``timeout_s``; must be below it).
    """

    def __init__(
        self,
        trainers: ActorHandle | Sequence[ActorHandle],
        receivers: Sequence[ActorHandle],
        *,
        source: str | None = None,
        target: str | None = None,
        rename: MappingABC[str, str] | Callable[[str], str | None] | None = None,
        fuse: MappingABC[str, Fuse | Sequence[str]] | None = None,
        scales: MappingABC[str, str] | None = None,
        transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
        atomic: bool = False,
        fence: str | None = None,
        commit: str = "all",
        aside: str = "shadow",
        on_commit: str | Callable[[Any, int], None] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        transport: str = "auto",
        verify: bool = False,
        progress: bool | None = None,
        name: str = "weights",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        stall_s: float | None = None,
    ) -> None:
        trainers = (trainers,) if isinstance(trainers, ActorHandle) else tuple(trainers)
        check_actors([*trainers, *receivers], "WeightSync (trainers and receivers)")
        if not trainers:
            raise ValueError("WeightSync needs at least one trainer")
        if not receivers:
            raise ValueError("WeightSync needs at least one receiver")
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError("bucket_bytes must be a positive number of bytes")
        if commit not in ("all", "each"):
            raise ValueError(f"commit={commit!r}: expected 'all' (every receiver or none) or 'each' (each on its own)")
        if aside not in ("shadow", "none") or (aside == "none" and (commit != "all" or atomic)):
            raise ValueError(f"aside={aside!r}: expected 'shadow', or 'none' with commit='all' (and no atomic)")
        if on_commit is not None and not (isinstance(on_commit, str) and on_commit) and not callable(on_commit):
            raise TypeError("on_commit must name a receiver method or be a function f(actor, version)")
        stall_s = timeout_s / 2 if stall_s is None else validate_timeout(stall_s)
        if stall_s >= timeout_s:
            raise ValueError(f"stall_s={stall_s:g} must be below timeout_s={timeout_s:g} (how long trainers wait)")
        if transport != "auto":
            from tensorwire.transport import registry

            registry.get_transport_class(transport)  # unknown names: "did you mean"
        self.trainers = trainers
        self.source = source
        self.target = target or source
        self.bucket_bytes = bucket_bytes
        self.transport = "" if transport == "auto" else transport
        self.verify = verify
        self.atomic = atomic
        self.fence = fence
        self.commit = commit
        self.aside = aside
        self.on_commit = on_commit
        self.transform = transform
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.name = name
        self.timeout_s = timeout_s
        self.stall_s = stall_s
        self.version = 0  # the last version pushed
        self.committed = 0  # the last version committed (all-or-none: by every receiver; "each": by one)
        self._promised = 0  # in place: the version the receivers voted to write (they hold their fences)
        self._pushes = 0
        self.sync_id = f"{id(self):x}-{time.monotonic_ns():x}"
        self._closed = False
        self._dead: set[int] = set()
        self._receivers: dict[int, ActorHandle] = {}
        self._layouts: dict[int, tuple[HeldParam, ...]] = {}
        self.receiver_descriptions: dict[int, tuple[bytes, int]] = {}
        self._next_id = 0
        self.caught_up: dict[int, str] = {}  # receiver id -> where its first version came from
        self._roles: tuple[Any, bool, dict[int, bytes], dict[int, tuple[Role, ...]], int] | None = None
        mapping = Mapping.build(rename, fuse, scales)
        refs = [call_hook(t, sync_hooks.layout, source, "source") for t in trainers]
        layouts = calls.gather(refs, timeout_s=timeout_s)
        self.trainer_layouts = [tuple(layout) for layout in layouts]
        self.trainer_descriptions = describe_actors(trainers, timeout_s)
        self._trainer_ids = list(range(len(trainers)))  # names stay when a trainer drops out
        self.plan = Plan(self.trainer_layouts, mapping)
        for actor in receivers:
            self.add_receiver(actor)
        if aside == "none" and not two_sources(self, tuple(self._receivers)):
            raise ValueError(
                "aside='none' needs every receiver byte held by two trainers (replicas), so that a trainer "
                "lost mid-push can be replaced; here some have one: use aside='shadow'"
            )

    # ------------------------------------------------------------------ membership

    @property
    def receivers(self) -> tuple[ActorHandle, ...]:
        """The receivers, in the order they joined (dead ones until removed)."""
        return tuple(self._receivers.values())

    @property
    def receiver_layouts(self) -> dict[int, tuple[HeldParam, ...]]:
        """Receiver id -> the pieces it described (what its plan was made from)."""
        return dict(self._layouts)

    @property
    def receiver_ids(self) -> tuple[int, ...]:
        """The receivers' ids, in the order of :attr:`receivers` and :meth:`versions`."""
        return tuple(self._receivers)

    @property
    def nbytes(self) -> int:
        """The largest receiver's bytes per push."""
        return max(self.plan.receiver_nbytes().values(), default=0)

    def add_receiver(self, actor: ActorHandle, *, catch_up: bool = True) -> int:
        """Plan a new receiver (between pushes); the others' plans stay. Returns its id (the
        key of its entries in reports) once it holds the last committed version (``catch_up``,
        when there is one): copied from a live receiver with the same layout that holds it,
        sparing the trainers, else pushed from the trainers (their tensors as they are now:
        that version while they did not change since). ``caught_up[id]`` says which."""
        if self._closed:
            raise RuntimeError("this WeightSync was closed")
        check_actors([*self.trainers, *self._receivers.values(), actor], "WeightSync.add_receiver")
        (layout,) = calls.gather([call_hook(actor, sync_hooks.layout, self.target, "target")], timeout_s=self.timeout_s)
        layout = tuple(layout)
        description = describe_actors([actor], self.timeout_s)[0]
        receiver = self._next_id
        self.plan.add_receiver(receiver, layout)
        self._next_id += 1
        self._receivers[receiver] = actor
        self._layouts[receiver] = layout
        self.receiver_descriptions[receiver] = description
        if catch_up and self.committed:
            try:
                push_to = functools.partial(self._push, catch_up=True)
                self.caught_up[receiver] = join.catch_up(self, receiver, push_to, self._dead)
            except BaseException:
                self.remove_receiver(receiver)
                raise
        return receiver

    def remove_receiver(self, receiver: ActorHandle | int, *, timeout_s: float = 30.0) -> None:
        """Drop a receiver (by handle or id) between pushes; frees what it kept (if alive)."""
        rid = receiver if isinstance(receiver, int) else self._id_of(receiver)
        if rid not in self._receivers:
            raise ValueError(f"receiver {receiver!r} is not in this WeightSync")
        actor = self._receivers.pop(rid)
        self.plan.remove_receiver(rid)
        for table in (self._layouts, self.receiver_descriptions):
            table.pop(rid, None)
        if rid not in self._dead:
            # died or late: nothing left to free there (passed over); the hook itself failing is raised
            outcome = calls.settle(call_hook(actor, sync_hooks.release, self.sync_id), timeout_s=timeout_s)
            if outcome.failure is calls.CallFailure.FAILED and outcome.error is not None:
                raise outcome.error
        self._dead.discard(rid)

    def _id_of(self, actor: ActorHandle) -> int:
        for rid, known in self._receivers.items():
            if calls.same_actor(known, actor):
                return rid
        raise ValueError(f"{actor!r} is not a receiver of this WeightSync")

    # ------------------------------------------------------------------ pushing

    def push(self) -> SyncReport:
        """Push the trainers' current tensors as the next version; returns the report.

        Receivers that die or fail are listed in ``report.failed`` (and left out of later
        pushes if they died); the others are complete.

        A trainer that dies or stalls mid-push is dropped and the rest runs again from the
        others when they hold every receiver's bytes (``report.replaced``, ``kept_nbytes``).

        Raises:
            TensorwireError: A trainer failed, or died or stalled with no other trainer holding
                its bytes (the message names it and why; ``.report`` has what the receivers did).
        """
        if self._closed:
            raise RuntimeError("this WeightSync was closed")
        self.version += 1
        replaced: dict[str, str] = {}
        have: dict[int, Held] | None = None
        lost: dict[tuple[str, str], int] = {}  # (replaced trainer, receiver) -> failovers
        start = time.perf_counter()
        while True:
            live = tuple(r for r in self._receivers if r not in self._dead)
            try:
                try:
                    report = self._push(live, self.version, have)
                    break
                except TensorwireError as e:  # a trainer died or stalled: complete from the others if they can
                    if getattr(e, "trainer", None) is None or not self._fail_over(e, replaced, lost):
                        raise
            except BaseException:
                self._abandon(live)
                raise
            actors = {r: self._receivers[r] for r in live}
            have = failover.arrived(self.sync_id, self.version, actors, self._layouts, timeout_s=self.timeout_s)
        in_place = self._promised == self.version
        report.replaced, report.seconds = replaced, time.perf_counter() - start  # every try
        report.pairs.update(failover_pairs(lost))
        record(self.name, failover_pairs(lost))
        # (in place, once voted, a receiver that failed or died after is torn or gone: the others hold it)
        committed_all = in_place or not any(not why.startswith("left out") for why in report.failed.values())
        if report.receivers and (self.commit == "each" or committed_all):
            self.committed = self.version
        return report

    def _push(
        self, live: tuple[int, ...], version: int, have: MappingABC[int, Held] | None = None, *, catch_up: bool = False
    ) -> SyncReport:
        """Push the trainers' tensors into the ``live`` receivers as ``version`` (``have``:
        pieces they hold already, after a failover: not kept for the next push; ``catch_up``:
        to a newcomer alone, which serves nothing yet: in place even from a single source)."""
        key = (live, self.progress, catch_up) if have is None else None  # a failover's try is not kept
        if have is None:
            self._promised = 0  # a first try (a push, a catch-up): in place, it votes
        voted = self._promised == version
        if have is not None or self._roles is None or self._roles[0] != key:
            in_place = voted or (self.aside == "none" and (catch_up or two_sources(self, live)))
            if self.aside == "none" and not in_place:
                logger.warning("weight sync %s: some bytes have one trainer left: assembled aside", self.name)
            self._roles = (key, in_place, *member_specs(self, live, have, in_place=in_place, voted=voted))
        _key, in_place, blobs, roles, buckets = self._roles
        self._pushes += 1
        channel = f"tw-sync-{self.sync_id}-{self._pushes}"
        m = len(self.trainers)
        started, start = time.time(), time.perf_counter()
        trainer_refs = [call_hook(t, sync_hooks.send, blobs[i], version, channel) for i, t in enumerate(self.trainers)]
        receiver_refs = {
            r: call_hook(self._receivers[r], sync_hooks.receive, blobs[m + i], version, channel)
            for i, r in enumerate(live)
        }
        vote = None
        if self.commit == "all" and not voted:  # (in place, a failover's next try: voted already)
            ranks = {m + i: self.receiver_descriptions[r][0] for i, r in enumerate(live)}
            vote = Vote(channel, ranks, timeout_s=self.timeout_s)
        members = {ref: self._trainer_name(i) for i, ref in enumerate(trainer_refs)}
        members.update({ref: f"receiver {rid}" for rid, ref in receiver_refs.items()})
        trainer_roles = [role for rank in range(m) for role in roles[rank]]
        waiting = PushWait(version, buckets, self.plan.nbytes, progress=self.progress, timeout_s=self.timeout_s)
        try:
            stalls = waiting.wait(members, channel, trainer_roles, vote, trainer_refs)
        finally:
            if in_place and vote is not None and vote.committed:
                self._promised = version  # the receivers write it: from here on, only forward
        seconds = time.perf_counter() - start
        report = SyncReport(version, self.nbytes, buckets, seconds, 0.0, 0.0, 0.0, 0.0)
        for rid in self._dead:
            report.failed[rid] = "left out: it died in an earlier push"
        for rid, ref in receiver_refs.items():
            outcome = calls.settle(ref, timeout_s=self.timeout_s)
            if outcome.failure is calls.CallFailure.ACTOR_DIED:
                self._dead.add(rid)
                report.failed[rid] = f"the receiver died: {outcome.reason}"
                continue
            if outcome.failure is calls.CallFailure.FAILED:
                report.failed[rid] = outcome.reason
                continue
            if outcome.error is not None:  # timed out
                raise outcome.error
            result: ReceiveResult = outcome.value
            if not result.committed:
                report.failed[rid] = f"not committed: {result.refused}"
                continue
            report.receivers[rid] = result
            report.moved_nbytes += result.nbytes
            report.plan_nbytes += self.plan.receiver_nbytes_of(rid)
            report.transfer_s = max(report.transfer_s, result.transfer_s)
            report.unpack_s = max(report.unpack_s, result.unpack_s)
            report.verify_s = max(report.verify_s, result.verify_s)
            report.aside_nbytes = max(report.aside_nbytes, result.aside_nbytes)
        names = {i: self._trainer_name(i) for i in range(m)} | {m + i: f"receiver {r}" for i, r in enumerate(live)}
        failed = [
            f"receiver {r}" for r, why in report.failed.items() if not why.startswith(("left out", "not committed"))
        ]
        report.kept_nbytes = report.plan_nbytes - report.moved_nbytes if have is not None else 0
        for i, reporter in stalls.items():
            self._telemetry(report, names, started, [*failed, self._trainer_name(i)])
            raise self._trainer_error(
                report, i, f"stalled: {names.get(int(reporter), reporter)} got no bucket from it in {self.stall_s:g} s"
            )
        wrote_all = all(r in report.receivers or r in self._dead for r in live)
        for i, ref in enumerate(trainer_refs):
            outcome = calls.settle(ref, timeout_s=self.timeout_s)
            if outcome.failure is calls.CallFailure.ACTOR_DIED and (
                wrote_all if in_place else vote is not None and vote.committed
            ):
                failed.append(self._trainer_name(i))  # died after the receivers committed: the next push replaces it
                continue
            if not outcome.ok:
                self._telemetry(report, names, started, [*failed, self._trainer_name(i)])
            if outcome.failure is calls.CallFailure.ACTOR_DIED:
                raise self._trainer_error(report, i, f"died during the push: {outcome.reason}") from None
            if outcome.failure is calls.CallFailure.FAILED and self._promised == version:  # in place: only forward
                raise self._trainer_error(report, i, f"failed during the push: {outcome.reason}") from None
            if outcome.error is not None:  # the trainer failed (Ray's error carrying it), or timed out
                outcome.error.report = report  # type: ignore[attr-defined]
                raise outcome.error
            report.pack_s = max(report.pack_s, outcome.value.pack_s)
            report.peak_staging_nbytes = max(report.peak_staging_nbytes, outcome.value.peak_nbytes)
            report.in_place_nbytes += outcome.value.in_place_nbytes
        self._telemetry(report, names, started, failed, retry=have is not None)
        return report

    def _abandon(self, live: tuple[int, ...]) -> None:
        """A push that fails after in-place receivers voted: they let go of their fences (those
        that wrote part of the version are ``TORN``: the next push mends them)."""
        if self._promised != self.version:
            return
        refs = [call_hook(self._receivers[r], sync_hooks.abandon, self.sync_id) for r in live if r not in self._dead]
        done, _late = calls.wait_all(refs, timeout_s=self.timeout_s)
        for ref in done:
            calls.settle(ref, timeout_s=1.0)  # (one that died or failed let go by itself)

    def _trainer_error(self, report: SyncReport, i: int, what: str) -> TensorwireError:
        """The error of a push whose trainer ``i`` died or stalled (failover may replace it)."""
        error = TensorwireError(f"weight sync v{report.version}: {self._trainer_name(i)} ({self.trainers[i]!r}) {what}")
        error.report, error.trainer = report, i  # type: ignore[attr-defined]
        return error

    def _fail_over(self, error: TensorwireError, replaced: dict[str, str], lost: dict[tuple[str, str], int]) -> bool:
        """Drop the trainer that ``error`` names and plan over the others; False (the error
        gets why) when they do not hold every receiver's bytes."""
        dead = error.trainer  # type: ignore[attr-defined]
        receivers = {rid: layout for rid, layout in self._layouts.items() if rid not in self._dead}
        plan, why = replan_without(dead, self.trainer_layouts, self.plan.mapping, receivers)
        if plan is None:
            kept = "the receivers keep the version they had"
            if self._promised == self.version:
                kept = "receivers that wrote part of it are torn (-1) till the next push"
            error.args = (f"{error.args[0]}; no failover: {why}; {kept}",)
            return False
        logger.warning("weight sync %s: %s; pushing the rest from the others", self.name, error.args[0])
        replaced[self._trainer_name(dead)] = error.args[0]
        failover.count_lost(lost, self.plan, dead, self._trainer_name(dead))
        keep = [i for i in range(len(self.trainers)) if i != dead]
        self.trainers = tuple(self.trainers[i] for i in keep)
        self.trainer_layouts = [self.trainer_layouts[i] for i in keep]
        self.trainer_descriptions = [self.trainer_descriptions[i] for i in keep]
        self._trainer_ids = [self._trainer_ids[i] for i in keep]
        self.plan, self._roles = plan, None  # staging and shadows stay: the next try reuses them
        return True

    def _trainer_name(self, position: int) -> str:
        return f"trainer {self._trainer_ids[position]}"

    def _telemetry(
        self, report: SyncReport, names: dict[int, str], started: float, failed: list[str], *, retry: bool = False
    ) -> None:
        """The push's per-pair view (report.pairs, report.timeline), added to the Prometheus totals."""
        report.pairs, report.timeline = pairs_of(report.receivers, names, started, failed, retry=retry)
        record(self.name, report.pairs)

    # ------------------------------------------------------------------ state

    def versions(self) -> list[int]:
        """The version each receiver holds completely (0: none yet; -1: unreachable)."""
        return sync_versions.versions(self._receivers, self.name)

    def wait_version(self, version: int, *, timeout_s: float = 60.0) -> list[int]:
        """Wait until every receiver not known dead holds ``version`` or a later one; returns
        what each holds (as :meth:`versions`).

        Raises:
            TimeoutError: Some did not within ``timeout_s`` (named, with what they hold).
        """
        return sync_versions.wait_version(self._receivers, self.name, version, dead=self._dead, timeout_s=timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Free the staging memory the sync keeps between pushes (two buckets of shared memory
        per stream a process serves, the receivers' mappings of them and atomic shadows). Idempotent."""
        if self._closed:
            return
        self._closed = True
        refs = [call_hook(a, sync_hooks.release, self.sync_id) for a in (*self.trainers, *self._receivers.values())]
        # One deadline for all (bounded whatever the number of actors); late ones are named.
        done, late = calls.wait_all(refs, timeout_s=validate_timeout(timeout_s))
        for ref in done:
            calls.settle(ref, timeout_s=1.0)  # a member that died or failed has nothing left to free
        if late:
            logger.warning("weight sync %s: %d actor(s) did not release within %.0f s", self.name, len(late), timeout_s)

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
