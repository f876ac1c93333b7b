"""The optimizer step in the walk of one update (trainer/plan/ledger.py UpdateWalk): the
step reads the gradients in place and allocates what its optimizer needs for a moment
(trainer/plan/optimizer_memory.py: fused adam nothing; adafactor and lamb every update;
muon its exchange and owner buffers); then the gradients are freed. Torch-free.
"""

from trainer.plan.optimizer_memory import EARLY_GATHER, alive_at_early_gather, step_moments


def optimizer_step(walk):
    """Each moment of the step that holds the most, in turn. Where the trainer steps with
    EarlyGather (parallelize.EarlyGather, several ranks), the root and the first layer are
    gathered for the next forward during the step."""
    m, s, L = walk.m, walk.s, walk.ledger
    for moment in step_moments(m, s):
        step_moment(walk, moment, on_host=walk.offload and s.optimizer != "muon")
    if s.sharded and s.world > 1 and s.optimizer in EARLY_GATHER:
        alive = alive_at_early_gather(m, s)
        for k, v in alive.items():
            L.add(k, v)
        L.transient("gathered_parameters", m.root_params * walk.elem + (walk.unit_of(0) if m.layers else 0))
        for k, v in alive.items():
            L.sub(k, v)


def step_moment(walk, nbytes, on_host):
    """{component: bytes} alive together for a moment; under --cpu-offload an
    optimizer's temporaries are the host's, beside its state."""
    if on_host:
        return
    for k, v in nbytes.items():
        walk.ledger.add(k, v)
    for k, v in nbytes.items():
        walk.ledger.sub(k, v)
