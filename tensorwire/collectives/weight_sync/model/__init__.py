"""A model of a push at cluster scale: where each rank runs (:mod:`.cluster`), the bucket flows
the plan makes over the links (:mod:`.flows`), and their time with links shared as the push
shares them (:mod:`.simulate`); layouts of published models to try it on (:mod:`.templates`)."""
