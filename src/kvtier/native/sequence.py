"""One request's state as the scheduler tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.native.sampling import SamplingParams, TokenLogprobs

LOGGED_CHARS = 64  # of a client-chosen id or name in one log line


def loggable(text: str, cap: int = LOGGED_CHARS) -> str:
    """Client text (a request id, a field name) as a log line shows it: escaped like repr()
    (no newline or control character reaches the log) and at most `cap` characters, with the
    full length when cut."""
    if len(text) <= cap:
        return repr(text)
    return f"{text[:cap]!r}... ({len(text)} chars)"


class SequenceStatus(enum.Enum):
    """Lifecycle: WAITING -> [WAITING_FOR_REMOTE_KVS ->] RUNNING -> FINISHED (vLLM's names)."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request: its tokens, its blocks, how much of it is computed and where that came from.

    `num_computed_tokens` counts tokens whose KV is in the cache now. After admission it is the
    HBM hit; a synchronous external load adds its tokens at once, an asynchronous one when the
    load finishes. `num_cached_tokens` (HBM prefix hit) and `num_external_tokens` (what the
    connector loaded successfully) describe the first admission only, set once when its outcome
    is known; a re-admission after preemption changes neither, so their sum never exceeds the
    prompt.
    """

    __slots__ = (
        "arrival",
        "block_hashes",
        "block_ids",
        "finish_reason",
        "load",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_external_tokens",
        "num_hashed_blocks",
        "output_token_ids",
        "params",
        "preempted",
        "prompt_token_ids",
        "request_id",
        "retention",
        "retention_granted",
        "seed",
        "status",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        arrival: int,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output, appended as tokens arrive
        self.output_token_ids: list[int] = []
        self.params = params
        self.seed = seed
        self.arrival = arrival
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks of token_ids
        self.num_hashed_blocks = 0  # leading blocks already offered to the prefix cache
        self.num_cached_tokens = -1  # -1 until the first admission's outcome is known
        self.num_external_tokens = 0
        self.load: ExternalLoad | None = None
        self.finish_reason: str | None = None
        # admitted again after a preemption: its admissions count apart, as vLLM's do
        self.preempted = False
        # the client's retention hint (an offload.retention.RetentionHint) and what it was
        # granted (the connector's answer, read when the request ends)
        self.retention: object | None = None
        self.retention_granted: dict[str, object] | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length."""
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output (do not mutate)."""
        return self.token_ids

    def append_token(self, token: int) -> None:
        """Record one sampled token."""
        self.token_ids.append(token)
        self.output_token_ids.append(token)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )


class ExternalLoad:
    """A connector load into this sequence's blocks covering tokens [start, end)."""

    __slots__ = ("end", "first_bad_block", "is_async", "start")

    def __init__(self, start: int, end: int, is_async: bool) -> None:
        self.start = start  # the HBM floor: nothing below it is loaded
        self.end = end
        self.is_async = is_async
        self.first_bad_block: int | None = None  # index in block_ids of the first failed block

    def block_range(self, block_size: int) -> range:
        """Indices (in the sequence's block table) of the blocks this load writes."""
        return range(self.start // block_size, -(-self.end // block_size))

    def good_end(self, block_size: int) -> int:
        """Tokens valid after the load: its end, or the start of its first failed block."""
        if self.first_bad_block is None:
            return self.end
        return max(self.start, min(self.end, self.first_bad_block * block_size))


@dataclass
class RequestOutput:
    """What one step (or `Engine.generate`) reports about one request."""

    request_id: str
    new_token_ids: list[int]  # sampled in this step
    output_token_ids: list[int]  # every token so far
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or "error" once finished
    prompt_tokens: int
    # first admission only (set once); the sum is OpenAI's cached_tokens, < prompt_tokens
    num_cached_tokens: int  # HBM prefix hit
    num_external_tokens: int  # tokens the connector loaded successfully
    text: str | None = None  # filled by `Engine.generate` when a tokenizer is present
    logprobs: TokenLogprobs | None = None  # of the new token, when the request asked
    error: str | None = None  # why the request failed (finish_reason "error")
    retention: dict[str, object] | None = None  # what a retention hint was granted (at the end)
