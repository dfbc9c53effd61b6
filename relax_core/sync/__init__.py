"""Weight sync: how the trainer's policy version v reaches the rollout engines.

`protocol.WeightSync` names the five verbs. Transports: `InProcessSync` (colocate),
`BroadcastSender`/`BroadcastReceiver` (a gloo or NCCL group) and
`ObjectStoreSender`/`ObjectStoreReceiver` (safetensors versions on the run's store). Receivers
stage complete updates; the engine loop applies one between generate calls with `apply_update`.

May import: config, queue, rollout.
"""

from relax_core.sync.apply import StagingPool, Update, UpdateSlot, UpdateTensors, apply_update
from relax_core.sync.broadcast import BroadcastSender
from relax_core.sync.broadcast_group import rendezvous_path
from relax_core.sync.broadcast_receiver import BroadcastReceiver
from relax_core.sync.buckets import (
    Bucket,
    LayoutMismatch,
    TensorSpec,
    layout_fingerprint,
    plan_buckets,
    specs_of,
)
from relax_core.sync.inprocess import InProcessSync
from relax_core.sync.object_store import ObjectStoreReceiver, ObjectStoreSender
from relax_core.sync.protocol import WeightSync

__all__ = [
    "BroadcastReceiver",
    "BroadcastSender",
    "Bucket",
    "InProcessSync",
    "LayoutMismatch",
    "ObjectStoreReceiver",
    "ObjectStoreSender",
    "TensorSpec",
    "StagingPool",
    "Update",
    "UpdateSlot",
    "UpdateTensors",
    "WeightSync",
    "apply_update",
    "layout_fingerprint",
    "plan_buckets",
    "rendezvous_path",
    "specs_of",
]
