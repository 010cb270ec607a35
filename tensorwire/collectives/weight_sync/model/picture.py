"""A picture of a modelled push (:func:`.simulate.simulate`): each kind of link's use over time
(the busiest link of the kind and the mean over its links), the bound marked (needs matplotlib:
``tensorwire[plot]``)."""

from __future__ import annotations

import numpy as np

from tensorwire.collectives.weight_sync.model.simulate import Modelled

__all__ = ["plot_links"]


def plot_links(modelled: Modelled, path: str, *, title: str) -> None:
    """Write the picture as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    ms = modelled.times * 1e3
    kinds: dict[str, list[int]] = {}
    for i, link in enumerate(modelled.links):
        kinds.setdefault(f"{link.kind} {link.way}" if link.kind != "memory" else "memory", []).append(i)
    for kind, columns in sorted(kinds.items()):
        used = modelled.utilisation[:, columns] if len(ms) else np.zeros((0, len(columns)))
        used = used[:, used.max(axis=0) > 0] if used.size else used  # the links of the kind the push uses
        if not used.size:
            continue
        (line,) = ax.plot(ms, used.max(axis=1), label=f"{kind}: busiest")
        ax.plot(
            ms, used.mean(axis=1), color=line.get_color(), linestyle=":", label=f"{kind}: mean of {used.shape[1]} used"
        )
    ax.axvline(modelled.bound_s * 1e3, color="black", linewidth=0.8, label=f"bound {modelled.bound_s * 1e3:.1f} ms")
    ax.set_xlabel("ms since the push began")
    ax.set_ylabel("link use (0-1)")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.legend(fontsize="small", loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
