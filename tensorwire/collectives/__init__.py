"""Collectives over groups of actors, and weight sync (``tw.collective``, ``tw.WeightSync``).

Two rooms: ``groups/`` (group collectives and their backends) and ``weight_sync/`` (pushing
trainers' weights into receivers).

Driver: ``create_group(actors, backend=..., name=...)``, ``destroy_group(name)``;
inside a member actor: ``get_group(name)`` and its ``broadcast``/``all_reduce``/... methods.
Weight sync: ``tw.WeightSync(trainers, receivers, ...)``; pieces described with ``Sharded``
(``Shard``/``Replicate`` placements, like DTensor's), fused parameters with ``Fuse``;
``plan_sync`` plans from layouts alone; inside receivers ``weight_version`` / ``weight_fence``;
``set_fault_point`` for fault-injection tests.
"""

from tensorwire.collectives.groups import (
    BACKENDS,
    Backend,
    Group,
    GroupInfo,
    ReduceOp,
    create_group,
    destroy_group,
    get_group,
    group_names,
)
from tensorwire.collectives.weight_sync import (
    TORN,
    Box,
    Fuse,
    NameMap,
    ParamPiece,
    Plan,
    Replicate,
    Shard,
    Sharded,
    SyncReport,
    WeightSync,
    plan_sync,
    set_fault_point,
    weight_fence,
    weight_version,
)

__all__ = [
    "BACKENDS",
    "TORN",
    "Backend",
    "Box",
    "Fuse",
    "Group",
    "GroupInfo",
    "NameMap",
    "ParamPiece",
    "Plan",
    "ReduceOp",
    "Replicate",
    "Shard",
    "Sharded",
    "SyncReport",
    "WeightSync",
    "create_group",
    "destroy_group",
    "get_group",
    "group_names",
    "plan_sync",
    "set_fault_point",
    "weight_fence",
    "weight_version",
]
