"""This process's agent, as the layers above the transport reach it.

Inside a Ray driver or worker the agent takes three settings from Ray before it starts (node
id, address, cluster token: :mod:`.ray.env` registers that start-up step when imported, without
importing Ray); outside Ray it starts as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorwire.runtime.ray import env as _ray_env  # noqa: F401 - registers the Ray start-up step
from tensorwire.transport.agent import get_agent

if TYPE_CHECKING:
    from tensorwire.transport.agent import AgentServices

__all__ = ["agent"]


def agent() -> AgentServices:
    """This process's agent, configured from Ray first when running inside Ray."""
    return get_agent()
