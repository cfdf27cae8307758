"""What a rank hands back to the launching process (through its engine's result file), and the one
way a job says that its engine stopped it for good. Shared by both sides; torch-free."""

from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class RankResult:
    # The rank's last logged metrics (rank 0's are the job's; empty elsewhere).
    metrics: dict[str, object] = field(default_factory=dict)
    # Why the engine stopped the job for good (a time limit, a preemption, nothing to resume from), if it did.
    stopped: str | None = None
    # What the store did not take of rank 0's records (they stay in the journal), if it did not take all.
    tracking_incomplete: str | None = None

    @classmethod
    def from_data(cls, data: object) -> "RankResult":
        """A rank's result carried back as plain data (its fields; launcher=ray's JSON from a
        cluster), each checked: raises ValueError naming what is not what a rank returns."""
        names = [f.name for f in fields(cls)]
        if not isinstance(data, dict) or not set(data) <= set(names):
            raise ValueError(f"not a table of {', '.join(names)}")
        metrics = data.get("metrics", {})
        numbers = isinstance(metrics, dict) and all(
            isinstance(value, int | float) and not isinstance(value, bool) for value in metrics.values()
        )
        if not numbers:
            raise ValueError("its metrics are not a table of numbers")
        for name in ("stopped", "tracking_incomplete"):
            if not isinstance(data.get(name), str | None):
                raise ValueError(f"its {name} is not text")
        return cls(**data)


class JobStopped(RuntimeError):
    """The engine stopped the job (a time limit, a preemption) and it cannot resume: its run ends KILLED."""

    interrupted = True  # tracking.run.outcome: KILLED
