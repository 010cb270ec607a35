"""Versions and how they become visible: the push's version state in the driver
(:mod:`.state`), the all-or-none vote (:mod:`.vote`), the driver's wait for a push
(:mod:`.push_wait`), a receiver's commit and its fence (:mod:`.receiver`, :mod:`.fence`),
where a version is assembled aside (:mod:`.aside`), and the versions receivers hold
(:mod:`.versions`)."""

__all__: list[str] = []
