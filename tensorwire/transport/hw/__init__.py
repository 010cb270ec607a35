"""Hardware discovery: node and process identity, devices by physical id, accelerator vendors,
links and NICs (:mod:`.topology`, :mod:`.accelerators`), and this machine's measured transport
costs (:mod:`.calibration`)."""

__all__: list[str] = []
