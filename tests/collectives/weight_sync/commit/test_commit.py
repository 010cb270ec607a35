"""All-or-none weight-sync versions: a failure anywhere leaves every receiver bit-exactly at
the version it had; ``on_commit`` once per commit; ``wait_version`` in the driver."""

from __future__ import annotations

import pytest
import ray
import torch

import tensorwire as tw
from tests.collectives.actors import Holder, digests, note_commit

NBYTES = 8 << 20


def make(receivers: int = 3, **options):
    trainer = Holder.remote(32, NBYTES, seed=1)
    others = [Holder.remote(32, NBYTES, seed=None) for _ in range(receivers)]
    sync = tw.WeightSync(trainer, others, source="weights", bucket_bytes=1 << 20, **options)
    return trainer, others, sync


def test_a_receiver_killed_mid_push_commits_nobody_and_the_next_push_commits_the_rest(ray_local):
    trainer, receivers, sync = make(on_commit="note_commit")
    assert sync.push().ok
    v1 = ray.get(trainer.digest.remote())
    ray.get(trainer.step.remote(5))
    ray.get(receivers[1].die_at.remote("receiver", 2))  # after 3 of its 8 buckets
    report = sync.push()
    assert not report.ok and set(report.failed) == {0, 1, 2}, report.failed
    assert "died" in report.failed[1]
    assert all(report.failed[r].startswith("not committed: abort: receiver 1 died") for r in (0, 2)), report.failed
    live = [receivers[0], receivers[2]]
    assert digests(live) == [v1, v1]  # bit-exactly version 1
    assert sync.versions() == [1, -1, 1]
    assert ray.get([r.commits_seen.remote() for r in live]) == [[("method", 1)]] * 2  # none for the aborted push
    report = sync.push()  # the dead one is left out: the others commit
    assert set(report.failed) == {1} and set(report.receivers) == {0, 2}
    assert digests(live) == [ray.get(trainer.digest.remote())] * 2
    assert sync.versions() == [3, -1, 3]
    assert sync.committed == 3  # the live receivers all committed it (the dead one is left out)
    assert ray.get([r.commits_seen.remote() for r in live]) == [[("method", 1), ("method", 3)]] * 2
    sync.close()


def test_a_receiver_without_the_named_fence_aborts_the_push_for_all(ray_local):
    _trainer, _receivers, sync = make(receivers=2, fence="no_such_fence")
    report = sync.push()
    assert set(report.failed) == {0, 1} and all(
        "no fence attribute 'no_such_fence'" in w for w in report.failed.values()
    )
    assert sync.versions() == [0, 0] and sync.committed == 0
    sync.close()


def test_a_trainer_killed_mid_push_leaves_every_receiver_at_the_last_version(ray_local):
    trainer, receivers, sync = make(on_commit=note_commit)
    assert sync.push().ok
    v1 = ray.get(trainer.digest.remote())
    ray.get(trainer.step.remote(5))
    ray.get(trainer.die_at.remote("trainer", 3))
    with pytest.raises(tw.TensorwireError, match=r"trainer 0 .* died during the push") as failure:
        sync.push()
    assert set(failure.value.report.failed) == {0, 1, 2}
    assert digests(receivers) == [v1] * 3 and sync.versions() == [1, 1, 1]
    assert ray.get([r.commits_seen.remote() for r in receivers]) == [[("function", 1)]] * 3


def test_best_effort_commits_the_others_when_one_receiver_dies(ray_local):
    trainer, receivers, sync = make(commit="each")
    ray.get(receivers[1].die_at.remote("receiver", 2))
    report = sync.push()
    assert set(report.failed) == {1} and "died" in report.failed[1]
    assert digests([receivers[0], receivers[2]]) == [ray.get(trainer.digest.remote())] * 2
    assert sync.versions() == [1, -1, 1]
    sync.close()


def test_wait_version_returns_what_receivers_hold_and_names_those_behind(ray_local):
    _trainer, _receivers, sync = make(receivers=2)
    assert sync.wait_version(0, timeout_s=10) == [0, 0]
    sync.push()
    assert sync.wait_version(1, timeout_s=10) == [1, 1]
    with pytest.raises(TimeoutError, match=r"receiver\(s\) \{0: 1, 1: 1\} .* not at version 2 after 0.3 s"):
        sync.wait_version(2, timeout_s=0.3)
    sync.close()


def test_bad_commit_options_are_refused(ray_local):
    trainer = Holder.remote(2, 4096, seed=1)
    receiver = Holder.remote(2, 4096, seed=None)
    with pytest.raises(ValueError, match="commit='some'"):
        tw.WeightSync(trainer, [receiver], source="weights", commit="some")
    with pytest.raises(TypeError, match="on_commit"):
        tw.WeightSync(trainer, [receiver], source="weights", on_commit=3)


@pytest.mark.parametrize("prepare", [True, False])
def test_prepare_rehearses_a_push_aside_and_commits_nothing(ray_local, prepare):
    """``prepare=True`` (the default): the receivers' shadow copies are made and filled when the
    sync is built, by a rehearsal push that commits nothing (their tensors, versions and
    ``on_commit`` untouched); ``prepare=False`` leaves all that to the first push."""
    trainer, receivers, sync = make(receivers=2, prepare=prepare, on_commit="note_commit")
    try:
        before = digests(receivers)
        aside = ray.get([r.aside_nbytes.remote(sync.sync_id) for r in receivers])
        assert aside == ([NBYTES] * 2 if prepare else [0, 0])
        assert digests(receivers) == before != [ray.get(trainer.digest.remote())] * 2
        assert sync.versions() == [0, 0] and sync.committed == 0
        assert ray.get([r.commits_seen.remote() for r in receivers]) == [[], []]
        assert sync.push().ok and digests(receivers) == [ray.get(trainer.digest.remote())] * 2
        assert ray.get([r.aside_nbytes.remote(sync.sync_id) for r in receivers]) == [NBYTES] * 2
        assert sync.versions() == [1, 1] and ray.get(receivers[0].commits_seen.remote()) == [("method", 1)]
    finally:
        sync.close()


def test_prepare_has_nothing_to_rehearse_where_receivers_write_in_place(ray_local):
    _trainer, receivers, sync = make(receivers=1, commit="each", prepare=False)
    try:
        assert sync.prepare() is False  # no aside copies to make: a rehearsal would write their tensors
        assert ray.get(receivers[0].aside_nbytes.remote(sync.sync_id)) == 0 and sync.versions() == [0]
    finally:
        sync.close()


@pytest.mark.parametrize("publish", ["swap", "copy"])
def test_publish_swap_trades_memory_with_the_shadows_and_copy_copies(ray_local, publish):
    """``publish="swap"``: each receiver tensor stays the same object but takes its shadow's
    memory (the new version), the shadow the old memory, so two buffers alternate from push to
    push; ``"copy"`` keeps the tensors' memory. The bytes are the trainer's either way."""
    trainer, receivers, sync = make(receivers=2, publish=publish)
    try:
        before = ray.get(receivers[0].data_ptrs.remote())
        pointers = []
        for step in range(3):
            ray.get(trainer.step.remote(step + 10))
            assert sync.push().ok
            assert digests(receivers) == [ray.get(trainer.digest.remote())] * 2
            pointers.append(ray.get(receivers[0].data_ptrs.remote()))
        if publish == "swap":
            assert pointers[0] != before and pointers[1] == before and pointers[2] == pointers[0]
        else:
            assert pointers == [before] * 3
        assert sync.versions() == [3, 3]
    finally:
        sync.close()


def test_publish_swap_needs_shadows(ray_local):
    trainer = Holder.remote(2, 1 << 16, seed=1)
    receiver = Holder.remote(2, 1 << 16, seed=None)
    for bad in ({"publish": "move"}, {"publish": "swap", "commit": "each"}):
        with pytest.raises(ValueError, match="publish="):
            tw.WeightSync(trainer, [receiver], source="weights", **bad)


@tw.remote(num_cpus=0)
class Linear:
    """An actor with an ``nn.Module``, and a method giving fresh detached copies of its tensors."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(64, 32)

    def detached(self) -> dict:
        return {name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()}

    def look(self) -> tuple[list[int], list[bool], float]:
        params = list(self.model.parameters())
        return [p.data_ptr() for p in params], [p.requires_grad for p in params], float(sum(p.sum() for p in params))


def test_publish_swap_reaches_a_modules_own_parameters_and_refuses_copies(ray_local):
    """A module's parameters take their shadows' memory and stay the module's ``Parameter`` s
    (still requiring grad); a receiver that gives fresh copies of its tensors each time is refused
    when the sync is made (its rehearsal): the swap would not reach its own tensors."""
    trainer, receiver, copies = Linear.remote(1), Linear.remote(2), Linear.remote(3)
    sync = tw.WeightSync(trainer, [receiver], source="model", publish="swap")
    try:
        ptrs, grads, _total = ray.get(receiver.look.remote())
        assert sync.push().ok
        after, grads_after, total = ray.get(receiver.look.remote())
        assert after != ptrs and grads_after == grads == [True, True]
        assert total == pytest.approx(ray.get(trainer.look.remote())[2])
    finally:
        sync.close()
    with pytest.raises(tw.TensorwireError, match="new tensor object for 'weight'"):
        tw.WeightSync(trainer, [copies], source="model", target="detached", publish="swap")
