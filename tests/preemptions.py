"""Which requests an engine preempts: the parity tests prove that preemption happened and changed nothing."""


def record_preemptions(engine) -> list[str]:
    """A list that fills with the id of each request engine's scheduler preempts from now on."""
    preempted: list[str] = []
    preempt = engine.scheduler._preempt

    def spy(seq):
        preempted.append(seq.request_id)
        preempt(seq)

    engine.scheduler._preempt = spy
    return preempted
