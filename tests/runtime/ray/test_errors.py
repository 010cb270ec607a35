"""ProducerDiedError is tensorwire's OwnerDiedError and Ray's ActorDiedError at once, and
survives pickling (Ray carries it from the reader to the caller)."""

from __future__ import annotations

import pickle

import ray.exceptions

import tensorwire as tw
from tensorwire.runtime.ray.errors import ProducerDiedError


def test_caught_as_either_and_pickled_whole():
    error = ProducerDiedError("the owner of object 7 has exited", "ab12")
    assert isinstance(error, tw.OwnerDiedError) and isinstance(error, ray.exceptions.ActorDiedError)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is ProducerDiedError
    assert str(back) == "the owner of object 7 has exited" and back.actor_id == "ab12"


def test_inside_rays_task_error_it_is_still_both():
    """What a consumer's caller gets when the argument could not be read."""
    try:
        raise ProducerDiedError("the owner of object 7 has exited")
    except ProducerDiedError as cause:
        task_error = ray.exceptions.RayTaskError("double", "traceback", cause)
    raised = task_error.as_instanceof_cause()
    assert isinstance(raised, ray.exceptions.ActorDiedError) and isinstance(raised, tw.OwnerDiedError)
    assert "has exited" in str(raised.cause)
