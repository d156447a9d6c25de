"""One step's plan as the scheduler hands it on: to the connector's `build_connector_meta` and
to the model runner (vLLM keeps it apart from its scheduler likewise, in `sched/output.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.native.sequence import Sequence


@dataclass(slots=True)
class ScheduledRequest:
    """A request running in this step and how many of its tokens the step computes."""

    seq: Sequence
    num_new_tokens: int
    is_new: bool  # admitted from the waiting queue in this step

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.seq.request_id

    @property
    def computed_after_step(self) -> int:
        """Tokens in the cache once this step's forward is done (read before it runs)."""
        return self.seq.num_computed_tokens + self.num_new_tokens


@dataclass
class SchedulerOutput:
    """One step's plan, handed to `build_connector_meta` and turned into the runner's input."""

    scheduled: list[ScheduledRequest]
    finished_req_ids: set[str]  # finished or aborted since the previous step
    preempted_req_ids: set[str]
    has_sync_loads: bool  # some admitted request loads external tokens within this step
    # requests whose latest sampled token was thrown away (drawn from KV a synchronous load
    # failed to write): rank 0 rewinds their seeded generators before this step samples again
    resampled_req_ids: set[str] = field(default_factory=set)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """Request id -> tokens computed for it in this step."""
        return {s.request_id: s.num_new_tokens for s in self.scheduled}

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens in the step's forward."""
        return sum(s.num_new_tokens for s in self.scheduled)
