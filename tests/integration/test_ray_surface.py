"""Each part of Ray that tensorwire uses beyond Ray's documented API (listed in
``tensorwire/runtime/ray_surface.py``) still works as tensorwire expects: a Ray release that
changes one fails here, naming it."""

from __future__ import annotations

import ray

from tensorwire.runtime import ray_surface


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Plain:
    def value(self) -> int:
        return 1


def _wrapped_in_a_list(method):
    def decorate(invocation):
        def invoke(args, kwargs):
            return [invocation(args, kwargs)]

        return invoke

    method.__ray_invocation_decorator__ = decorate
    return method


def _one_more_argument(method):
    def decorate(invocation):
        def invoke(args, kwargs):
            return invocation((*args, 5), kwargs)  # tw.remote lifts references to trailing arguments so

        return invoke

    method.__ray_invocation_decorator__ = decorate
    return method


@ray.remote(num_cpus=0)
class Decorated:
    @_wrapped_in_a_list
    def value(self) -> int:
        return 2

    @_one_more_argument
    def total(self, *values: int) -> int:
        return sum(values)


def test_every_listed_access_is_there(ray_local):
    handle = Plain.remote()
    for name in ("__ray_call__", "__ray_ready__", "__ray_terminate__"):
        assert hasattr(handle, name), f"Ray changed ActorHandle.{name} (listed in tensorwire/runtime/ray_surface.py)"
    assert ray_surface.run_on_actor(handle, lambda actor: actor.value(), timeout_s=60) == 1, (
        "ActorHandle.__ray_call__ in the _ray_system concurrency group no longer runs a function in the actor"
    )
    decorated = Decorated.remote()
    [inner] = decorated.value.remote()
    assert ray.get(inner, timeout=60) == 2, "Ray no longer applies method.__ray_invocation_decorator__ in the caller"
    assert ray.get(decorated.total.remote(1, 2), timeout=60) == 8, (
        "method.__ray_invocation_decorator__ can no longer change the call's arguments"
    )
    assert "_ray_weak_ref" in vars(handle), "Ray changed ActorHandle._ray_weak_ref (listed in ray_surface.py)"
