"""A push of some parameters only (``push(names=...)``, ``push(changed=...)``).

LoRA training changes its adapters only; frozen towers and embeddings never change. A subset
push moves the receivers' parameters that the named trainer parameters feed, each *whole*
(a fused ``qkv`` whose ``q`` changed is pushed with its ``k`` and ``v``: a shadow assembled
aside is then complete, whether it is published by copy or by trading memory), and leaves
the others as they are; the version applies to the whole model. It is planned as a push in
which every receiver already holds what the subset leaves out (:func:`left_out`, the same
``have`` a failover's try reads less by), and each receiver publishes only the parameters
the subset rewrites (:func:`targets`).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping

from tensorwire.collectives.weight_sync.planning.layout import Box
from tensorwire.collectives.weight_sync.planning.plan import Arrived, Plan, Transfer

__all__ = ["Subset", "held_where", "left_out", "merged", "subset_of"]

Subset = Mapping[int, frozenset[str]]  # receiver id -> the receiver parameters a subset push rewrites


def subset_of(plan: Plan, names: Iterable[str] | None, changed: Callable[[str], bool] | None) -> Subset | None:
    """Per receiver, the parameters a push of trainer parameters ``names`` (or those for which
    ``changed(name)`` is true) rewrites; None for a whole push (neither given).

    Raises:
        ValueError: Both given, a name the trainers do not sync (with close matches), or nothing chosen.
    """
    if names is None and changed is None:
        return None
    if names is not None and changed is not None:
        raise ValueError("give names= or changed=, not both")
    synced = sorted({t.source for transfers in plan.receivers.values() for t in transfers})
    if names is not None:
        if isinstance(names, str):
            raise TypeError("names= takes a list of trainer parameter names, not one string")
        chosen = frozenset(names)
        unknown = sorted(chosen.difference(synced))
        if unknown:
            close = difflib.get_close_matches(unknown[0], synced, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(f"names= has {len(unknown)} name(s) the trainers do not sync: {unknown[:5]}{hint}")
    else:
        chosen = frozenset(n for n in synced if changed(n))
    if not chosen:
        raise ValueError("the subset is empty: no trainer parameter was chosen (push nothing: skip the push)")
    return {r: frozenset(t.target for t in transfers if t.source in chosen) for r, transfers in plan.receivers.items()}


def left_out(plan: Plan, only: Subset) -> dict[int, Arrived]:
    """Per receiver, the pieces a push of ``only`` leaves as they are, as pieces it holds."""
    return held_where(plan, plan.receivers, lambda r, t: t.target not in only.get(r, frozenset()))


def held_where(plan: Plan, receivers: Iterable[int], keep: Callable[[int, Transfer], bool]) -> dict[int, Arrived]:
    """Per receiver of ``receivers``, the pieces of its transfers in ``plan`` for which
    ``keep(receiver, transfer)``, as pieces it holds (what a push then leaves out)."""
    result: dict[int, Arrived] = {}
    for r in receivers:
        held: dict[tuple[str, str], list[Box]] = {}
        for t in plan.receivers[r]:
            if keep(r, t):
                held.setdefault((t.target, t.wire_dtype), []).append(t.dst)
        result[r] = held
    return result


def merged(first: Mapping[int, Arrived] | None, second: Mapping[int, Arrived] | None) -> dict[int, Arrived] | None:
    """Pieces held by either account (None when neither has any)."""
    if first is None or second is None:
        return None if first is None and second is None else dict(first or second or {})
    result: dict[int, Arrived] = {}
    for r in set(first) | set(second):
        held: dict[tuple[str, str], list[Box]] = {}
        for account in (first.get(r, {}), second.get(r, {})):
            for key, boxes in account.items():
                held.setdefault(key, []).extend(boxes)
        result[r] = held
    return result
