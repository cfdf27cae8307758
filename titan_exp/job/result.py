"""What a rank hands back to the launching process (through its engine's result file), and the one
way a job says that its engine stopped it for good. Shared by both sides; torch-free."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RankResult:
    # The rank's last logged metrics (rank 0's are the job's; empty elsewhere).
    metrics: dict[str, object] = field(default_factory=dict)
    # Why the engine stopped the job for good (a time limit, a preemption, nothing to resume from), if it did.
    stopped: str | None = None
    # What the store did not take of rank 0's records (they stay in the journal), if it did not take all.
    tracking_incomplete: str | None = None


class JobStopped(RuntimeError):
    """The engine stopped the job (a time limit, a preemption) and it cannot resume: its run ends KILLED."""

    interrupted = True  # tracking.run.outcome: KILLED
