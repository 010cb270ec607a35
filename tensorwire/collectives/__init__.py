"""Collectives over groups of actors, and weight sync (``tw.collective``, ``tw.WeightSync``).

Driver: ``create_group(actors, backend=..., name=...)``, ``destroy_group(name)``;
inside a member actor: ``get_group(name)`` and its ``broadcast``/``all_reduce``/... methods.
"""

from tensorwire.collectives.api import GroupInfo, create_group, destroy_group
from tensorwire.collectives.group import BACKENDS, Group, get_group, group_names
from tensorwire.collectives.weight_sync import SyncReport, WeightSync, weight_version

__all__ = [
    "BACKENDS",
    "Group",
    "GroupInfo",
    "SyncReport",
    "WeightSync",
    "create_group",
    "destroy_group",
    "get_group",
    "group_names",
    "weight_version",
]
