"""Collectives over groups of actors, and weight sync (``tw.collective``, ``tw.WeightSync``).

Driver: ``create_group(actors, backend=..., name=...)``, ``destroy_group(name)``;
inside a member actor: ``get_group(name)`` and its ``broadcast``/``all_reduce``/... methods.
Weight sync: ``tw.WeightSync(trainers, receivers, ...)``; pieces described with ``Sharded``
(``Shard``/``Replicate`` placements, like DTensor's), fused parameters with ``Fuse``;
``plan_sync`` plans from layouts alone; inside receivers ``weight_version`` / ``weight_fence``;
``set_fault_point`` for fault-injection tests.
"""

from tensorwire.collectives.api import GroupInfo, create_group, destroy_group
from tensorwire.collectives.group import BACKENDS, Backend, Group, ReduceOp
from tensorwire.collectives.groups import get_group, group_names
from tensorwire.collectives.layout import Box, HeldParam, Replicate, Shard, Sharded
from tensorwire.collectives.plan import Fuse, Mapping, Plan, plan_sync
from tensorwire.collectives.receiver_state import TORN
from tensorwire.collectives.sync_hooks import set_fault_point, weight_fence
from tensorwire.collectives.weight_sync import SyncReport, WeightSync, weight_version

__all__ = [
    "BACKENDS",
    "TORN",
    "Backend",
    "Box",
    "Fuse",
    "Group",
    "GroupInfo",
    "HeldParam",
    "Mapping",
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
