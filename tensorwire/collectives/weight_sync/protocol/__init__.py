"""What the driver and the members of a push say to each other: the spec each member is told
and what it answers (:mod:`.spec`), how the driver works those specs out from the plan
(:mod:`.assign`), and every message key, message format and reason (:mod:`.messages`)."""

__all__: list[str] = []
