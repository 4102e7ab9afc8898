"""What the engine knows about one request: its sampling parameters, its tokens, how far its
KV cache is computed, and its timings.

One counter drives everything (the vLLM v1 idea): `num_computed_tokens`, the number of
leading tokens whose K/V are in the cache. Each step the scheduler tries to bring it up to
`num_tokens` (prompt + generated so far). When a step brings it all the way, the model's
logits for the last token are sampled and one token is appended, so again
`num_computed_tokens == num_tokens - 1`.

Invariants:
- 0 <= num_computed_tokens <= num_tokens; a WAITING request holds no blocks and has
  num_computed_tokens == 0; a RUNNING one holds a block table with a slot for every
  computed token.
- Preemption by recompute keeps `output_token_ids`: the generated tokens are recomputed as
  part of the request's "prompt" when it is admitted again, so its output never changes.
- For n > 1 the engine runs one `Request` per sample (`index` 0..n-1). They share the
  prompt's blocks (fork, then copy-on-write) and sample with seed + index.
- A seeded request's generator lives on `device` (the model's), so its draws happen where
  the logits are, with no copy to the host (`minillm.engine.model_runner.sample_tokens`).

Async scheduling (`minillm.engine.overlap`): a token sampled by the step in flight is
appended as a placeholder, `PENDING`, and counted in `num_pending_tokens` until the host
reads its value back (`resolve_token`). `num_tokens` counts placeholders, so the scheduler
can schedule the next decode; only the last `num_pending_tokens` output tokens can be
placeholders (at most two: the step in flight and the one just launched), and nothing that
needs a token's value (prefix-cache hashes, stop checks, the runner's host input ids,
outputs) may read them. PENDING is -1: as a token id it fails loudly (an embedding index,
a block's hash check) instead of passing for a real token.
"""
from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..prompts import stop_token_set
from ..sampling import make_generator, validate_sampling

PENDING = -1  # an output token sampled by a step whose ids are not read back yet


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. `max_tokens` counts generated tokens (prompt excluded)."""
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1 (tokens to generate), "
                             f"got {self.max_tokens!r}")
        validate_sampling(self.temperature, self.top_k, self.top_p)
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be None or an int >= 0, got {self.seed!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n (samples per prompt) must be an int >= 1, got {self.n!r}")
        if self.stop_token_ids is not None:
            ids = tuple(self.stop_token_ids)
            if not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ValueError(f"stop_token_ids must be token ids (ints >= 0), got {ids!r}")
            object.__setattr__(self, "stop_token_ids", ids)  # a list would break hashing

    def stop_ids(self, eos_token_id: int | None) -> frozenset[int]:
        return stop_token_set(self.stop_token_ids, eos_token_id, self.ignore_eos)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter seconds) and the latencies derived from them.

    ttft = first token - arrival; itl = gaps between consecutive tokens;
    e2e = finish - arrival = ttft + sum(itl); queue_time = first scheduled - arrival.
    """
    arrival_time: float
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        t = self.first_scheduled_time
        return None if t is None else t - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2e(self) -> float | None:
        t = self.finished_time
        return None if t is None else t - self.arrival_time

    def to_dict(self) -> dict:
        itl = self.itl
        return {"queue_time": self.queue_time, "ttft": self.ttft, "e2e": self.e2e,
                "mean_itl": sum(itl) / len(itl) if itl else None,
                "num_output_tokens": len(self.token_times),
                "num_preemptions": self.num_preemptions}


class Request:
    """One sequence in the engine (for n > 1: one sample of a prompt)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_id: int | None = None, index: int = 0,
                 arrival_time: float | None = None, device: torch.device | str | None = None):
        self.request_id, self.index = request_id, index
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_pending_tokens = 0  # trailing placeholders in output_token_ids (PENDING)
        self.params = params
        self.stop_ids = params.stop_ids(eos_token_id)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        # Samples 1..n-1 are forked from this one once its prompt is computed.
        self.num_pending_forks = params.n - 1 if index == 0 else 0
        seed = None if params.seed is None else params.seed + index
        self.device = device
        self.generator: torch.Generator | None = make_generator(seed, device)
        self.metrics = RequestMetrics(time.perf_counter() if arrival_time is None
                                      else arrival_time)

    @property
    def seq_id(self) -> tuple[str, int]:
        """The block manager's key: one block table per sample."""
        return (self.request_id, self.index)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output, without building the whole list."""
        n = len(self.prompt_token_ids)
        return (self.prompt_token_ids[start:min(end, n)]
                + self.output_token_ids[max(start - n, 0):max(end - n, 0)])

    def token_prefix(self, end: int) -> "TokenPrefix":
        """Tokens 0..end-1 as a read-only sequence that copies nothing until sliced."""
        return TokenPrefix(self, end)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_resolved_tokens(self) -> int:
        """Output tokens whose values are known (the rest are placeholders)."""
        return len(self.output_token_ids) - self.num_pending_tokens

    def append_token(self, token_id: int, now: float) -> bool:
        """Record a sampled token; return True (and set finish_reason) if the request is done.
        A stop token is kept in the output, as `minillm.generate` does."""
        self.output_token_ids.append(token_id)
        return self._token_known(len(self.output_token_ids) - 1, now)

    def append_pending(self) -> bool:
        """Append a placeholder for a token sampled on the device but not read back yet.
        Returns True if it is the last one by length (max_tokens): the request is done
        whatever its value, though the value may still make the reason "stop"."""
        self.output_token_ids.append(PENDING)
        self.num_pending_tokens += 1
        return len(self.output_token_ids) >= self.params.max_tokens

    def is_pending(self, pos: int) -> bool:
        """Is output token `pos` a placeholder still waiting for its value? False once
        resolved or dropped (`drop_pending`)."""
        return pos < len(self.output_token_ids) and self.output_token_ids[pos] == PENDING

    def resolve_token(self, pos: int, token_id: int, now: float) -> bool:
        """The value of placeholder `pos` (the oldest pending one) is known: write it in,
        then the same stop checks as `append_token`. A stop drops the placeholders after it
        (a step launched before the stop was known sampled them: their values are never
        used)."""
        assert pos == self.num_resolved_tokens and self.output_token_ids[pos] == PENDING, \
            f"placeholders resolve oldest first: got {pos} of {self!r}"
        self.output_token_ids[pos] = token_id
        self.num_pending_tokens -= 1
        return self._token_known(pos, now)

    def drop_pending(self) -> None:
        """Forget the placeholders (the request ended: their steps' results are dropped)."""
        if self.num_pending_tokens:
            del self.output_token_ids[-self.num_pending_tokens:]
            self.num_pending_tokens = 0

    def _token_known(self, pos: int, now: float) -> bool:
        """Output token `pos` has its value: True (and finish_reason) if it is the last."""
        self.metrics.token_times.append(now)
        if self.output_token_ids[pos] in self.stop_ids:
            self.finish_reason = "stop"
            self.drop_pending()
        elif pos + 1 >= self.params.max_tokens:
            self.finish_reason = "length"
        else:
            return False
        return True

    def fork(self, index: int, arrival_time: float) -> "Request":
        """Sample `index` of this prompt: same tokens and progress, its own generator."""
        child = Request(self.request_id, self.prompt_token_ids, self.params, None, index,
                        arrival_time, self.device)
        child.stop_ids = self.stop_ids
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        child.metrics.first_scheduled_time = self.metrics.first_scheduled_time
        return child

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}#{self.index}, {self.status.value}, "
                f"computed {self.num_computed_tokens}/{self.num_tokens})")


class TokenPrefix(Sequence):
    """The first `end` tokens of a request's prompt + output, read in place.

    What the block manager is handed every step for every running sequence: it reads the
    length, and the tokens of a block only when that block fills (one step in block_size).
    Building `all_token_ids` instead copied the whole sequence, twice per sequence per step:
    at 64 sequences of ~500 tokens, most of the scheduler's time. Valid while the request's
    tokens are only appended to (they are: see the module doc; a placeholder is
    overwritten or dropped only after the schedule() that read it is over)."""

    __slots__ = ("_request", "_end")

    def __init__(self, request: Request, end: int):
        self._request, self._end = request, end  # unchecked: made per sequence per step

    def __len__(self) -> int:
        return self._end

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self._end)
            if step == 1:
                return self._request.token_ids(start, max(start, stop))
            return self._request.token_ids(0, self._end)[i]
        if i < 0:
            i += self._end
        if not 0 <= i < self._end:
            raise IndexError(f"token {i} of a {self._end}-token prefix")
        return self._request.token_ids(i, i + 1)[0]


@dataclass
class RequestOutput:
    """What one step produced for one sample: the tokens new since the last output."""
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    index: int = 0                    # which of the n samples
    # All generated so far: the first num_generated of the request's output list, which
    # never change (shared, not copied: a copy per token per step grew with the output;
    # only placeholders past them are ever overwritten or dropped).
    generated: Sequence[int] = field(default=(), repr=False)
    num_generated: int = 0
    metrics: RequestMetrics | None = None

    @property
    def token_ids(self) -> list[int]:
        """Every token generated so far (a new list, built when read)."""
        return list(self.generated[:self.num_generated])
