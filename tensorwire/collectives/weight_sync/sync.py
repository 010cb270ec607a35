"""``tw.WeightSync``: push M trainers' weights into N receivers' tensors along a plan.

::

    sync = tw.WeightSync(trainers, receivers)     # actors made with @tw.remote; plan computed here
    print(sync.plan)                              # bytes per trainer -> receiver pair, totals
    report = sync.push()                          # every receiver now holds version 1
    sync.close()                                  # frees the staging memory

Each actor describes its pieces of every parameter (:mod:`.planning.layout`: plain tensors are
whole, DTensors and ``tw.collective.Sharded`` say which piece they are); the driver computes the
plan once (:mod:`.planning.plan`: renames, fused parameters, dtype conversion, load spread over
trainers that hold the same piece) and each push moves exactly the plan's bytes, all pairs at
once, in buckets of about ``bucket_bytes`` with at most two buckets staged per stream
(:mod:`.planning.buckets`, :mod:`.streams`; the actors' side in :mod:`.members`). One trainer
into identical receivers is the M = 1 case.

Versions: ``push()`` publishes the next version on every receiver or on none (``commit="all"``,
the default): each receiver assembles it in a shadow copy (one copy of its parameters, kept
across pushes), tells the driver, and publishes it with one local copy inside a fence (``fence=``
names an attribute of the receiver giving a lock or context manager; default
``tw.collective.weight_fence(name)``) once the driver saw every receiver ready; on any failure
every receiver keeps the version it had, bit for bit (:mod:`.commit`). ``commit="each"``: each
receiver commits on its own, in place (no shadow) unless ``atomic=True`` (a shadow, published
inside the fence). ``aside="none"`` (every byte held by two trainers): all-or-none with no
shadow, receivers voting before they write in place inside their fence (:mod:`.commit.fence`).
``on_commit`` runs in a receiver once per version it commits; ``wait_version(v)`` waits in the
driver until every receiver holds ``v``.

Membership: ``add_receiver`` / ``remove_receiver`` between pushes (:mod:`.recovery.late_joiners`).
A receiver that dies mid-push is dropped (``report.failed``); a trainer that fails fails the
push; one that dies or stalls is replaced when the others hold its bytes: the push reads what is
missing from them (:mod:`.recovery.failover`). One try of a push: :mod:`.push`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from tensorwire.collectives.groups.api import DEFAULT_TIMEOUT_S, check_actors, describe_actors
from tensorwire.collectives.weight_sync import in_flight
from tensorwire.collectives.weight_sync.commit import versions as receiver_versions
from tensorwire.collectives.weight_sync.commit.state import PushState
from tensorwire.collectives.weight_sync.in_flight import PushHandle
from tensorwire.collectives.weight_sync.members.common import layout_hook, release_hook
from tensorwire.collectives.weight_sync.planning import subsets
from tensorwire.collectives.weight_sync.planning.buckets import DEFAULT_BUCKET_BYTES
from tensorwire.collectives.weight_sync.planning.layout import ParamPiece
from tensorwire.collectives.weight_sync.planning.plan import Fuse, NameMap, Plan
from tensorwire.collectives.weight_sync.push import Prepared, run_try
from tensorwire.collectives.weight_sync.recovery import late_joiners
from tensorwire.collectives.weight_sync.recovery.failover import two_sources
from tensorwire.collectives.weight_sync.recovery.stalls import PATIENCE_FLOOR_S
from tensorwire.collectives.weight_sync.report.summary import SyncReport
from tensorwire.collectives.weight_sync.settings import checked_settings
from tensorwire.collectives.weight_sync.tries import push_version
from tensorwire.collectives.weight_sync.unchanged import Record
from tensorwire.errors import TensorwireError
from tensorwire.runtime.agent import agent as runtime_agent
from tensorwire.runtime.ray import calls
from tensorwire.runtime.ray.actor import ActorHandle
from tensorwire.runtime.ray.hooks import call_hook
from tensorwire.transport.agent.wire import peer_from_bytes
from tensorwire.transport.config import validate_timeout

__all__ = ["WeightSync"]

logger = logging.getLogger(__name__)


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
            ``"host"``: the same copy in host memory (pinned where CUDA is), published into the
            receivers' tensors by one host-to-device copy each inside the fence: a GPU receiver
            keeps one copy of its weights on the GPU (``publish="copy"`` only).
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
            replaced like a dead one (must be below ``timeout_s``). Default (None): adaptive
            (:mod:`.recovery.stalls`): a trainer whose process is stopped or does not answer is
            stalled after a few seconds or a few of its bucket times, one that runs but is slow
            is waited for (up to half of ``timeout_s`` per bucket).
        prepare: Rehearse a push when the sync is made (:meth:`prepare`), so that the first
            push costs what later ones do: receivers' aside copies allocated and touched,
            staging and connections made; nothing is committed.
        publish: How receivers publish a version assembled in shadows, inside their fence:
            ``"copy"`` (one local copy per tensor) or ``"swap"``: each tensor and its shadow
            trade memory (no copy; the tensor objects stay, a module's parameters included).
            Only where the receiver allows it: views taken of its tensors before a push (an
            engine's cached views, CUDA graphs) keep the old memory.
        load: Name of a receiver method taking an iterable of ``(name, tensor)`` pairs (an
            engine's ``load_weights``, which fuses, permutes or quantises as it loads). Each
            version is assembled aside (``aside``: beside or in host memory) and fed to it in one
            call inside the fence (the tensors are the sync's buffers: the loader copies what it
            keeps). ``target`` then gives what the loader takes, in its names: tensors, meta
            tensors (no memory) or ``Sharded`` pieces (the loader gets each piece); their memory
            is never written. Late joiners are pushed from the trainers.
        skip_unchanged: Before each whole push, the trainers checksum every bucket (one pass
            over their bytes) and a bucket whose bytes are those of the last version every
            receiver committed is not sent (:mod:`.unchanged`); its setup is then worked out
            again each push. Not with ``publish="swap"``; receivers that write in place must
            not change their tensors between pushes.

    Attributes:
        version: The last version pushed (or being pushed).
        committed: The last version the receivers hold (all-or-none: every live one).
        state: The push's version state (:class:`.commit.state.PushState`).
    """

    def __init__(
        self,
        trainers: ActorHandle | Sequence[ActorHandle],
        receivers: Sequence[ActorHandle],
        *,
        source: str | None = None,
        target: str | None = None,
        rename: Mapping[str, str] | Callable[[str], str | None] | None = None,
        fuse: Mapping[str, Fuse | Sequence[str]] | None = None,
        scales: Mapping[str, str] | None = None,
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
        prepare: bool = True,
        publish: str = "copy",
        load: str | None = None,
        skip_unchanged: bool = False,
    ) -> None:
        trainers = (trainers,) if isinstance(trainers, ActorHandle) else tuple(trainers)
        check_actors([*trainers, *receivers], "WeightSync (trainers and receivers)")
        stall_s = checked_settings(
            trainers,
            receivers,
            bucket_bytes=bucket_bytes,
            commit=commit,
            aside=aside,
            atomic=atomic,
            publish=publish,
            load=load,
            skip_unchanged=skip_unchanged,
            on_commit=on_commit,
            transport=transport,
            timeout_s=timeout_s,
            stall_s=stall_s,
        )
        self.trainers = trainers
        self.source, self.target = source, target or source
        self.bucket_bytes, self.verify, self.atomic, self.fence = bucket_bytes, verify, atomic, fence
        self.transport = "" if transport == "auto" else transport
        self.commit, self.skip_unchanged = commit, skip_unchanged
        self.aside, self.publish, self.load = aside, publish, load
        self.on_commit, self.transform = on_commit, transform
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.name, self.timeout_s, self.stall_s = name, timeout_s, stall_s
        self._start_empty()
        self._describe_trainers(NameMap.build(rename, fuse, scales))
        self._add_first_receivers(receivers, prepare=prepare)

    def _start_empty(self) -> None:
        """No push yet, no receiver yet."""
        self.state = PushState()
        self.prepared: Prepared | None = None  # the last push's setup (kept between pushes)
        self.sync_id = f"{id(self):x}-{time.monotonic_ns():x}"
        self.caught_up: dict[int, str] = {}  # receiver id -> where its first version came from
        self.receiver_actors: dict[int, ActorHandle] = {}
        self.receiver_descriptions: dict[int, tuple[bytes, int]] = {}
        self._layouts: dict[int, tuple[ParamPiece, ...]] = {}
        self._next_id = 0
        self._pushes = 0
        self._closed = False
        self.in_flight: PushHandle | None = None  # the last push_async's handle
        self.committed_buckets: Record | None = None  # skip_unchanged: the last version all committed
        self.overlapped = False  # a push_async runs: trainers serve beside their own calls

    def _add_first_receivers(self, receivers: Sequence[ActorHandle], *, prepare: bool) -> None:
        for actor in receivers:
            self.add_receiver(actor)
        if self.aside == "none" and not two_sources(self, tuple(self.receiver_actors)):
            raise ValueError(
                "aside='none' needs every receiver byte held by two trainers (replicas), so that a trainer "
                "lost mid-push can be replaced; here some have one: use aside='shadow'"
            )
        if prepare:
            try:
                self.prepare()
            except BaseException:
                self.close()  # (the members let go of what the rehearsal made)
                raise

    def _describe_trainers(self, mapping: NameMap) -> None:
        """Each trainer's pieces and address, and the plan over them (receivers come next)."""
        refs = [call_hook(t, layout_hook, self.source, "source") for t in self.trainers]
        self.trainer_layouts = [tuple(layout) for layout in calls.gather(refs, timeout_s=self.timeout_s)]
        self.trainer_descriptions = describe_actors(self.trainers, self.timeout_s)
        self._trainer_ids = list(range(len(self.trainers)))  # names stay when a trainer drops out
        self.plan = Plan(self.trainer_layouts, mapping)

    @property
    def version(self) -> int:
        """The last version pushed (or being pushed)."""
        return self.state.version

    @version.setter
    def version(self, version: int) -> None:
        self.state.version = version

    @property
    def committed(self) -> int:
        """The last version the receivers hold (all-or-none: every live receiver; ``"each"``: one)."""
        return self.state.committed

    # ------------------------------------------------------------------ membership

    @property
    def receivers(self) -> tuple[ActorHandle, ...]:
        """The receivers, in the order they joined (dead ones until removed)."""
        return tuple(self.receiver_actors.values())

    @property
    def receiver_layouts(self) -> dict[int, tuple[ParamPiece, ...]]:
        """Receiver id -> the pieces it described (what its plan was made from)."""
        return dict(self._layouts)

    @property
    def receiver_ids(self) -> tuple[int, ...]:
        """The receivers' ids, in the order of :attr:`receivers` and :meth:`versions`."""
        return tuple(self.receiver_actors)

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
        self._check_idle("add_receiver")
        check_actors([*self.trainers, *self.receiver_actors.values(), actor], "WeightSync.add_receiver")
        (layout,) = calls.gather([call_hook(actor, layout_hook, self.target, "target")], timeout_s=self.timeout_s)
        layout = tuple(layout)
        description = describe_actors([actor], self.timeout_s)[0]
        receiver = self._next_id
        self.plan.add_receiver(receiver, layout)
        self._next_id += 1
        self.receiver_actors[receiver] = actor
        self._layouts[receiver] = layout
        self.receiver_descriptions[receiver] = description
        if catch_up and self.committed:
            try:
                push_to = functools.partial(run_try, self, catch_up=True)
                self.caught_up[receiver] = late_joiners.catch_up(self, receiver, push_to, self.state.dead)
            except BaseException:
                self.remove_receiver(receiver)
                raise
        return receiver

    def remove_receiver(self, receiver: ActorHandle | int, *, timeout_s: float = 30.0) -> None:
        """Drop a receiver (by handle or id) between pushes; frees what it kept (if alive)."""
        self._check_idle("remove_receiver")
        rid = receiver if isinstance(receiver, int) else self._id_of(receiver)
        if rid not in self.receiver_actors:
            raise ValueError(f"receiver {receiver!r} is not in this WeightSync")
        actor = self.receiver_actors.pop(rid)
        self.plan.remove_receiver(rid)
        for table in (self._layouts, self.receiver_descriptions):
            table.pop(rid, None)
        if rid not in self.state.dead:
            # died or late: nothing left to free there (passed over); the hook itself failing is raised
            outcome = calls.settle(call_hook(actor, release_hook, self.sync_id), timeout_s=timeout_s)
            if outcome.failure is calls.CallFailure.FAILED and outcome.error is not None:
                raise outcome.error
        self.state.dead.discard(rid)

    def _id_of(self, actor: ActorHandle) -> int:
        for rid, known in self.receiver_actors.items():
            if calls.same_actor(known, actor):
                return rid
        raise ValueError(f"{actor!r} is not a receiver of this WeightSync")

    # ------------------------------------------------------------------ pushing

    def prepare(self) -> bool:
        """Make what pushes need before the first one, so that it costs what later ones do: a
        rehearsal push in which every receiver reads the trainers' tensors into its aside copies
        (allocated and touched now) and commits nothing, while the members load their specs, the
        trainers make their staging and the transports their connections. Runs when the sync is
        made (``prepare=True``, the default); only where versions are assembled aside (shadows:
        the default ``commit="all"``, or ``atomic``). Returns whether it rehearsed.

        Raises:
            TensorwireError: A member failed or died during the rehearsal (nothing changed).
        """
        self._check_idle("prepare")
        live = self.live_receivers()
        if not live or self.aside == "none" or not (self.atomic or self.commit == "all" or self.load):
            return False
        report = run_try(self, live, self.state.version, rehearsal=True)
        self.state.finish(committed=False)
        broken = {r: why for r, why in report.failed.items() if report.failure_kinds[r].fault_of_its_own}
        if broken:
            raise TensorwireError(f"weight sync {self.name}: the rehearsal failed in receiver(s) {broken}")
        return True

    def push(self, *, names: Iterable[str] | None = None, changed: Callable[[str], bool] | None = None) -> SyncReport:
        """Push the trainers' current tensors as the next version; returns the report.

        ``names`` (trainer parameter names) or ``changed`` (``f(trainer name) -> bool``, run
        here): push only those parameters (:mod:`.planning.subsets`: each receiver parameter
        they feed, whole); the receivers keep the others as they are and the version applies to
        the whole model.

        Receivers that die or fail are listed in ``report.failed`` (and left out of later
        pushes if they died); the others are complete.

        A trainer that dies or stalls mid-push is dropped and the rest runs again from the
        others when they hold every receiver's bytes (``report.replaced``, ``kept_nbytes``).

        Raises:
            TrainerLost: A trainer died or stalled with no other trainer holding its bytes (its
                position, why, and ``.report`` with what the receivers did).
            TensorwireError: A trainer failed (the message names it; ``.report``).
            RuntimeError: A ``push_async`` is in flight, or the sync was closed.
            ValueError: ``names`` the trainers do not sync, or an empty subset.
        """
        self._check_idle("push")
        return push_version(self, subsets.subset_of(self.plan, names, changed))

    def push_async(
        self,
        *,
        snapshot: bool = True,
        names: Iterable[str] | None = None,
        changed: Callable[[str], bool] | None = None,
    ) -> PushHandle:
        """Start pushing the next version and return once the trainers' bytes of it are fixed:
        the trainers may train the next step while it moves (:mod:`.in_flight`). ``snapshot``:
        each trainer copies the tensors it serves from first (one copy of its synced tensors,
        on their device, until the push ends); False: no copy, the caller keeps the trainers'
        tensors unchanged until the handle is done. ``names``/``changed``: as for :meth:`push`.
        ``handle.result()`` gives the report.

        Raises:
            RuntimeError: Another push is in flight (one per sync at a time), or the sync was closed.
            TensorwireError: A trainer could not copy its tensors (nothing was pushed).
        """
        self._check_idle("push_async")
        push = functools.partial(push_version, self, subsets.subset_of(self.plan, names, changed))
        self.in_flight = in_flight.start(self, push, snapshot=snapshot)
        return self.in_flight

    def _check_idle(self, what: str) -> None:
        """Refuse ``what`` on a closed sync, or while a push is in flight."""
        if self._closed:
            raise RuntimeError("this WeightSync was closed")
        if self.in_flight is not None and not self.in_flight.done():
            raise RuntimeError(
                f"{what}: push v{self.in_flight.version} of weight sync {self.name} is in flight (one at a time); "
                "wait for it first: handle.result()"
            )

    def live_receivers(self) -> tuple[int, ...]:
        """The receivers not known dead, by id."""
        return tuple(r for r in self.receiver_actors if r not in self.state.dead)

    def next_channel(self) -> str:
        """A new channel name for one try of a push."""
        self._pushes += 1
        return f"tw-sync-{self.sync_id}-{self._pushes}"

    def trainer_name(self, position: int) -> str:
        """How reports name the trainer at ``position`` (its index when the sync was made)."""
        return f"trainer {self._trainer_ids[position]}"

    def trainer_responds(self, position: int) -> bool:
        """Whether the trainer at ``position`` can act now: alive and not stopped; on another
        node, it answers a ping within the stall floor (3 s: a busy process answers sooner)."""
        peer = peer_from_bytes(self.trainer_descriptions[position][0])
        return runtime_agent().peer_responds(peer, timeout_s=PATIENCE_FLOOR_S)

    def trainer_stopped(self, position: int) -> bool:
        """Whether the trainer at ``position`` is alive but cannot act (stopped); one known to
        have exited is not stopped (its call fails, and the push fails over)."""
        peer = peer_from_bytes(self.trainer_descriptions[position][0])
        return runtime_agent().peer_may_be_alive(peer) and not self.trainer_responds(position)

    def drop_trainer(self, position: int, plan: Plan) -> None:
        """Leave the trainer at ``position`` out from now on, with ``plan`` over the others (a
        failover); the next try works its setup out again."""
        keep = [i for i in range(len(self.trainers)) if i != position]
        self.trainers = tuple(self.trainers[i] for i in keep)
        self.trainer_layouts = [self.trainer_layouts[i] for i in keep]
        self.trainer_descriptions = [self.trainer_descriptions[i] for i in keep]
        self._trainer_ids = [self._trainer_ids[i] for i in keep]
        self.plan, self.prepared = plan, None  # staging and shadows stay: the next try reuses them

    # ------------------------------------------------------------------ state

    def versions(self) -> list[int]:
        """The version each receiver holds completely (0: none yet; -1: unreachable)."""
        return receiver_versions.versions(self.receiver_actors, self.name)

    def wait_version(self, version: int, *, timeout_s: float = 60.0) -> list[int]:
        """Wait until every receiver not known dead holds ``version`` or a later one; returns
        what each holds (as :meth:`versions`).

        Raises:
            TimeoutError: Some did not within ``timeout_s`` (named, with what they hold).
        """
        return receiver_versions.wait_version(
            self.receiver_actors, self.name, version, dead=self.state.dead, timeout_s=timeout_s
        )

    def close(self, timeout_s: float = 30.0) -> None:
        """Free the staging memory the sync keeps between pushes (two buckets of shared memory
        per stream a process serves, the receivers' mappings of them and atomic shadows). Idempotent."""
        if self._closed:
            return
        if self.in_flight is not None and not self.in_flight.done():
            with contextlib.suppress(TimeoutError, TensorwireError, RuntimeError):  # the handle raises its error
                self.in_flight.result(timeout_s=timeout_s)
            if not self.in_flight.done():  # its members still use what close would free
                version = self.in_flight.version
                raise TimeoutError(
                    f"weight sync {self.name}: push v{version} is still in flight after {timeout_s:g} s; close "
                    "again once it ended (handle.result())"
                )
        self._closed = True
        refs = [call_hook(a, release_hook, self.sync_id) for a in (*self.trainers, *self.receiver_actors.values())]
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
