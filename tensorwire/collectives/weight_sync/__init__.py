"""Weight sync: push M trainers' tensors into N differently sharded receivers along a plan.

The driver's API is :class:`.sync.WeightSync`; one try of a push is :mod:`.push`. The rest, one
folder per concern:

* ``planning/``: layouts, name maps, the plan, the bucket policy (pure metadata);
* ``protocol/``: the spec each member is told, and every message key, format and reason;
* ``members/``: what runs inside the trainers and receivers;
* ``streams/``: serving a stream of buckets, and where its bytes wait;
* ``commit/``: versions, the vote, the fence, the driver's wait;
* ``recovery/``: failover, stall detection, what arrived, late joiners;
* ``report/``: the push's report and telemetry.
"""

from tensorwire.collectives.weight_sync.commit.receiver import TORN, weight_fence, weight_version
from tensorwire.collectives.weight_sync.members.common import set_fault_point
from tensorwire.collectives.weight_sync.planning.layout import Box, ParamPiece, Replicate, Shard, Sharded
from tensorwire.collectives.weight_sync.planning.plan import Fuse, NameMap, Plan, plan_sync
from tensorwire.collectives.weight_sync.report.summary import SyncReport
from tensorwire.collectives.weight_sync.sync import WeightSync

__all__ = [
    "TORN",
    "Box",
    "Fuse",
    "NameMap",
    "ParamPiece",
    "Plan",
    "Replicate",
    "Shard",
    "Sharded",
    "SyncReport",
    "WeightSync",
    "plan_sync",
    "set_fault_point",
    "weight_fence",
    "weight_version",
]
