"""Group collectives over tensorwire actors: ``create_group`` / ``destroy_group`` in the driver
(:mod:`.api`), membership inside the actors (:mod:`.membership`: ``get_group``), the ``Group``
interface (:mod:`.group`) and its two backends (:mod:`.torch_group`: torch.distributed;
:mod:`.tensorwire_group`: tensorwire's own transports), over a :mod:`.channel` of messages and
published objects between the members (which weight sync uses too)."""

from tensorwire.collectives.groups.api import GroupInfo, create_group, destroy_group
from tensorwire.collectives.groups.group import BACKENDS, Backend, Group, ReduceOp
from tensorwire.collectives.groups.membership import get_group, group_names

__all__ = [
    "BACKENDS",
    "Backend",
    "Group",
    "GroupInfo",
    "ReduceOp",
    "create_group",
    "destroy_group",
    "get_group",
    "group_names",
]
