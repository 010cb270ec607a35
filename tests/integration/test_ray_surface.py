"""Each part of Ray that tensorwire uses beyond Ray's documented API (listed in
``tensorwire/runtime/ray/surface.py``) still works as tensorwire expects: a Ray release that
changes one fails here, naming it."""

from __future__ import annotations

import ray

from tensorwire.runtime.ray import surface as ray_surface


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


# What this module checks, per entry of ray_surface.SURFACE (an entry added there without a check
# here fails test_every_listed_access_is_checked_here).
CHECKED = {
    "ActorHandle.__ray_call__",
    "ActorHandle.__ray_terminate__",
    "ActorHandle.__ray_ready__",
    "method.__ray_invocation_decorator__",
    "ActorHandle.__dict__ / _ray_weak_ref",
}


def test_every_listed_access_is_checked_here():
    assert set(ray_surface.SURFACE) == CHECKED


def test_every_listed_access_is_there(ray_local):
    handle = Plain.remote()
    listed = sorted(key.partition(".")[2] for key in ray_surface.SURFACE if key.startswith("ActorHandle.__ray_"))
    assert listed == ["__ray_call__", "__ray_ready__", "__ray_terminate__"]
    for name in listed:
        assert hasattr(handle, name), f"Ray changed ActorHandle.{name} (listed in tensorwire/runtime/ray/surface.py)"
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
