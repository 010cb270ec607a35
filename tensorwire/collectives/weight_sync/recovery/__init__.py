"""When a member is lost: a trainer that died or stalled is replaced from the others
(:mod:`.failover`), stalls are detected and reported (:mod:`.stalls`), receivers record what
arrived so that a second try reads only the rest (:mod:`.arrivals`), and a receiver added
between pushes catches up (:mod:`.late_joiners`)."""

__all__: list[str] = []
