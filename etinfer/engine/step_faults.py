"""What a failed step costs: the requests whose state the fault left unknown, and no others.

A step moves through stages; ``StepProgress`` records the one it is in, the batch it scheduled
and the outputs it has already produced. When a stage raises, the engine fails only the
requests that stage could have left half-updated, each with an error that names the stage,
returns their blocks and carries on (as vLLM v1 fails the requests of a step whose engine core
raised, while here the engine also stays up):

- admitting (grammars compiled in the meantime join the scheduler): none; a request is moved
  whole or not at all.
- scheduling: the running requests (the policy's ordering, preemptions and allocations are
  what failed); waiting ones keep their place.
- deciding, drafting, forward, sampling, measuring, committing, compaction, recording: the
  batch's requests, except those the step already finished (their output is complete, and
  they get it).
- finishing (delivering outputs): none fails; the requests the step had finished and not yet
  delivered get their outputs, the others go on (their next delta covers this step).
- observing: none; every request's step is done and its output produced (an observer that
  raises is logged and skipped by ``Observers.notify``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from etinfer.engine.scheduler import ScheduledBatch
from etinfer.engine.sequence import Sequence
from etinfer.outputs import RequestOutput

# Stages whose fault leaves the scheduled batch's requests in an unknown state.
BATCH_STAGES = frozenset(
    {
        "deciding",
        "drafting",
        "forward",
        "sampling",
        "measuring",
        "committing",
        "compaction",
        "recording",
    }
)


@dataclass
class StepProgress:
    stage: str = "admitting"
    batch: ScheduledBatch | None = None
    outputs: list[RequestOutput] = field(default_factory=list)


def requests_left_unknown(progress: StepProgress, running: list[Sequence]) -> list[Sequence]:
    """The requests a fault at ``progress.stage`` must end, in a stable order."""
    if progress.stage == "scheduling":
        candidates = list(running)
    elif progress.stage in BATCH_STAGES and progress.batch is not None:
        candidates = list(progress.batch.seqs)
    elif progress.stage == "finishing" and progress.batch is not None:
        candidates = [seq for seq in progress.batch.seqs if seq.finish_reason is not None]
    else:
        candidates = []
    return [seq for seq in candidates if not seq.is_finished]


def fault_message(stage: str, error: BaseException) -> str:
    return f"the engine failed in {stage}: {type(error).__name__}: {error}"
