"""Workflows: how one prompt group becomes trajectories.

A workflow (`Workflow`) is a small object with `run(prompt, n, generate) ->
list[Trajectory]`, and two methods a run calls whose defaults a subclass inherits:
`metrics()`, its own counters for the metrics log, and `close()`, which frees what it
holds when the run ends (an agent's endpoint, say). It runs
on a thread of its own (`rl.episodes`), so it may block on the futures `generate`
returns: `generate(tokens, n=1, *, max_new_tokens=None, stop_ids=None, hold_slot=False,
slot=None)` submits one generator request whose prompt is `tokens` and returns a future
of its n trajectories (each `tokens`, then what was generated); omitted arguments are
the run's sampling parameters. With `hold_slot`, a sample that ends on a stop id keeps
its slot and KV cache, and its trajectory's `metadata["slot"]` is the handle; a later
`generate(tokens, slot=handle)`, whose `tokens` continue that sample, decodes there
(or, if the pool evicted the slot, as a new request: the result is the same), and
`generate.release(handle)` frees a slot not continued; `on_tokens` receives the
new tokens as they are decoded (`generation.Request.on_tokens`). What `run` returns
is validated once, by the runner (`trajectory.validate`).

`SingleTurn` (the default) is one request of n samples. `MultiTurn` alternates policy
turns with environment turns: a policy turn that ends in one of `turn_stop_ids` (a tool
call, say) is answered by `respond`, whose tokens are appended with loss mask 0, no
behaviour log-prob and version -1; the next policy turn continues from the whole
episode so far. The episode is one trajectory; `trajectory.split_turns` makes one
training sample per policy turn of it instead (`task.sample_per_turn`).

Each policy turn after the first continues the episode in the slot its last turn
held (`hold_slots`), so the generator computes only the environment's tokens; where
the slot was evicted, or with `hold_slots=False`, the turn is a new request holding the
whole episode so far, which the generator prefills again (benchmarks/multi_turn.py
measures both). Either way every turn starts from a cache computed by the params
current when it starts (the pool re-prefills a held slot after a weight update), and
weight updates (retract, keep, drain) apply within a turn as for any request, so an
episode's policy tokens may carry several versions; the staleness bound applies to
each of them.
"""

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Optional, Protocol, runtime_checkable

import numpy as np

from async_rl.trajectory import Trajectory


class Generate(Protocol):
  """Submits one generator request of the group (see the module docstring)."""
  max_new_tokens: int  # the group's budget of tokens after its prompt

  def __call__(self, tokens: Sequence[int], n: int = 1, *, max_new_tokens: Optional[int] = None,
               stop_ids: Optional[Sequence[int]] = None, hold_slot: bool = False,
               slot: Any = None, on_tokens: Optional[Callable] = None) -> Future: ...

  def release(self, slot: Any) -> None: ...


@runtime_checkable
class Workflow(Protocol):
  """Turns a prompt group into trajectories (the module docstring). A subclass inherits
  `metrics` and `close`, which keep no counters and hold nothing; a workflow of its own
  that does not subclass it must have all three methods (`rl.build.preflight` checks)."""

  def run(self, prompt, n: int, generate: Generate) -> Sequence[Trajectory]: ...

  def metrics(self) -> dict[str, int]:
    """The workflow's own counters (an agent's lost episodes, say), for the metrics log."""
    return {}

  def close(self) -> None:
    """Frees what the workflow holds; the run is over."""


class SingleTurn(Workflow):
  """n samples of the prompt, in one request."""

  def run(self, prompt, n: int, generate: Generate) -> list[Trajectory]:
    return generate(prompt.tokens, n).result()


# `respond(prompt, tokens_T)` -> the environment's tokens after the policy's turn (the
# episode so far, prompt included, is `tokens_T`), or None to end the episode.
Respond = Callable[[Any, np.ndarray], Optional[Sequence[int]]]


@dataclasses.dataclass
class _Episode:
  tokens: list
  logp: list
  versions: list
  slot: Any = None  # The handle of the slot that holds the episode between turns.
  used: int = 0
  turns: int = 0
  finish: Optional[str] = None

  def append(self, tokens, logp=None, versions=None):
    tokens = np.asarray(tokens, np.int32)
    self.tokens.append(tokens)
    self.logp.append(np.zeros(tokens.size, np.float32) if logp is None else logp)
    self.versions.append(np.full(tokens.size, -1, np.int32) if versions is None else versions)
    self.used += tokens.size

  def context(self) -> np.ndarray:
    return np.concatenate(self.tokens)


@dataclasses.dataclass(frozen=True)
class MultiTurn(Workflow):
  """Policy turns and environment turns, n episodes of a prompt in lockstep.

  Turn 1 of the n episodes is one request of n samples; later turns are one request
  per unfinished episode, all submitted before any is waited for, each continuing in
  the slot that holds its episode if `hold_slots`. An episode ends:
  "stop" when a policy turn stops on anything but a turn stop id (EOS, say) or
  `respond` returns None; "length" when its `max_tokens` are used up (an environment
  reply is cut to fit); "max_turns" when its `max_turns`-th policy turn asks for
  another; "aborted" when a turn was aborted.

  Attributes:
    respond: the environment (see `Respond`); runs on the workflow's thread.
    max_turns: the most policy turns of an episode.
    max_tokens: the episode's budget of tokens after the prompt, policy and
      environment tokens together; None: the run's `max_new_tokens`
      (`generate.max_new_tokens`).
    turn_stop_ids: token ids that end a policy turn and hand over to `respond`.
    stop_ids: token ids that end the episode (the tokenizer's stop ids).
    hold_slots: keep each episode's slot and KV cache between its turns; False
      re-prefills the whole episode at every turn (the same tokens, more compute).
  """
  respond: Respond
  max_turns: int
  turn_stop_ids: tuple[int, ...]
  stop_ids: tuple[int, ...]
  max_tokens: Optional[int] = None
  hold_slots: bool = True

  def __post_init__(self):
    if self.max_turns < 1:
      raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
    if self.max_tokens is not None and self.max_tokens < 1:
      raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
    if set(self.turn_stop_ids) & set(self.stop_ids):
      raise ValueError(f"turn_stop_ids {self.turn_stop_ids} and stop_ids {self.stop_ids} "
                       f"must not share an id")

  def run(self, prompt, n: int, generate: Generate) -> list[Trajectory]:
    prompt_P = np.asarray(prompt.tokens, np.int32)
    budget = generate.max_new_tokens if self.max_tokens is None else self.max_tokens
    episodes = [_Episode([prompt_P], [np.zeros(prompt_P.size, np.float32)],
                         [np.full(prompt_P.size, -1, np.int32)]) for _ in range(n)]
    stops = (*self.turn_stop_ids, *self.stop_ids)
    active = episodes
    kw = {"stop_ids": stops, "hold_slot": self.hold_slots}
    try:
      turns = generate(prompt_P, n, max_new_tokens=budget, **kw).result()
      while True:
        for ep, turn in zip(active, turns):
          ep.slot = turn.metadata.get("slot")
        for ep, turn in zip(active, turns):
          self._policy_turn(ep, turn, budget)
          if ep.finish is None:
            self._environment_turn(prompt, ep, budget)
          if ep.finish is not None and ep.slot is not None:
            generate.release(ep.slot)
            ep.slot = None
        active = [ep for ep in active if ep.finish is None]
        if not active:
          break
        futures = []
        for ep in active:
          futures.append(generate(ep.context(), 1, max_new_tokens=budget - ep.used,
                                  slot=ep.slot, **kw))
          ep.slot = None  # Handed on: the pool continues or has evicted it.
        turns = [f.result()[0] for f in futures]
    finally:
      for ep in episodes:  # An episode cut short (a failed environment) frees its slot.
        if ep.slot is not None:
          generate.release(ep.slot)
    return [Trajectory(tokens_T=ep.context(), loss_mask_T=np.concatenate(ep.versions) >= 0,
                       logp_T=np.concatenate(ep.logp), versions_T=np.concatenate(ep.versions),
                       prompt_len=prompt_P.size, finish_reason=ep.finish,
                       metadata={"turns": ep.turns}) for ep in episodes]

  def _policy_turn(self, ep: _Episode, turn: Trajectory, budget: int):
    P = turn.prompt_len
    ep.append(turn.completion_C, turn.logp_T[P:], turn.versions_T[P:])
    ep.turns += 1
    if turn.finish_reason != "stop":
      ep.finish = turn.finish_reason
    elif int(turn.tokens_T[-1]) not in self.turn_stop_ids:
      ep.finish = "stop"
    elif ep.turns == self.max_turns:
      ep.finish = "max_turns"
    elif ep.used >= budget:
      ep.finish = "length"

  def _environment_turn(self, prompt, ep: _Episode, budget: int):
    reply = self.respond(prompt, ep.context())
    if reply is None:
      ep.finish = "stop"
      return
    reply = np.asarray(reply, np.int32).reshape(-1)
    room = budget - ep.used
    ep.append(reply[:room])
    if reply.size >= room:
      ep.finish = "length"
