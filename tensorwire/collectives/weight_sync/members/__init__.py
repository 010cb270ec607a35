"""What runs inside the sync's actors (hooks the driver calls through Ray): what every member
shares (:mod:`.common`: the tensors it holds, the spec of a push, release), the trainer's side
(:mod:`.trainer`: serve its streams), the receiver's side (:mod:`.receiver`: read every stream,
relay, commit) and how a receiver takes one bucket in (:mod:`.intake`)."""

__all__: list[str] = []
