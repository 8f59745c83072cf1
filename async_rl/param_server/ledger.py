"""The prompt ledger: where each started group's prompt came from, so none is lost.

Every group the gate lets start gets a ticket, recorded with its rollout worker and
its prompt's position in that worker's stream (an opaque, JSON-able dict: the
stream's state just before the prompt was drawn). A ticket stays open until its
group is rejected, dropped or trained into published params. Groups that will never
finish (their worker died, or the run resumed from a checkpoint taken while they
were open) have their positions queued for their worker to issue again, in the
order they were started, before it draws new prompts from its stream's cursor.
So a prompt is trained at most once into any params, and one that was lost is
generated again rather than skipped.

Plain Python and not thread-safe: its owner (the `ParameterServer`) calls it under
its lock.
"""

import dataclasses
from typing import Optional


@dataclasses.dataclass
class _Open:
  worker: int
  position: Optional[dict]
  running: bool = True


class PromptLedger:
  """Open tickets, each worker's stream cursor and the positions to issue again."""

  def __init__(self):
    self._next_ticket = 1
    self._open: dict[int, _Open] = {}
    self._cursor: dict[int, dict] = {}
    self._replay: dict[int, list[dict]] = {}
    self._written_off: set[int] = set()

  def start(self, worker: int, position: Optional[dict],
            next_position: Optional[dict]) -> int:
    """Opens a ticket for a group of `worker` drawn at `position`; returns it.

    `next_position` is the worker's stream state after the draw (its cursor). A
    group drawn at the head of the worker's replay queue takes it off the queue.
    Without positions the group is counted but cannot be issued again.
    """
    replay = self._replay.get(worker)
    if replay and position is not None and replay[0] == position:
      replay.pop(0)
    if next_position is not None:
      self._cursor[worker] = next_position
    ticket = self._next_ticket
    self._next_ticket += 1
    self._open[ticket] = _Open(worker, position)
    return ticket

  def is_running(self, ticket: int) -> bool:
    entry = self._open.get(ticket)
    return entry is not None and entry.running

  def was_written_off(self, ticket: int) -> bool:
    return ticket in self._written_off

  def admit(self, ticket: int) -> None:
    """The running group of `ticket` was admitted into the buffer."""
    self._open[ticket].running = False

  def close(self, ticket: int) -> None:
    """The group of `ticket` was rejected, dropped or trained: forget it."""
    del self._open[ticket]

  def register(self, worker: int) -> tuple[dict, int]:
    """A (new) worker `worker` starts: writes off what an earlier one left running.

    Returns its start, `{"cursor": stream state or None, "replay": [positions]}`,
    and how many running groups were written off.
    """
    lost = sorted(t for t, e in self._open.items() if e.worker == worker and e.running)
    self._queue_replays(lost)
    self._written_off.update(lost)
    return {"cursor": self._cursor.get(worker),
            "replay": list(self._replay.get(worker, []))}, len(lost)

  def state_dict(self) -> dict:
    """Cursors, and what to replay: the queued positions, then every open ticket's."""
    replay = {w: list(p) for w, p in self._replay.items()}
    for ticket in sorted(self._open):
      entry = self._open[ticket]
      if entry.position is not None:
        replay.setdefault(entry.worker, []).append(entry.position)
    return {"next_ticket": self._next_ticket,
            "cursor": {str(w): c for w, c in self._cursor.items()},
            "replay": {str(w): p for w, p in replay.items() if p}}

  def load_state_dict(self, state: dict) -> int:
    """Restores a `state_dict`, its open tickets lost and queued for replay; returns
    how many positions are queued."""
    missing = sorted({"next_ticket", "cursor", "replay"} - set(state))
    if missing:
      raise ValueError(f"ledger state is missing {missing}")
    self._next_ticket = int(state["next_ticket"])
    self._cursor = {int(w): c for w, c in state["cursor"].items()}
    self._replay = {int(w): list(p) for w, p in state["replay"].items()}
    self._open.clear()
    self._written_off.clear()
    return sum(map(len, self._replay.values()))

  def _queue_replays(self, tickets):
    for ticket in tickets:
      entry = self._open.pop(ticket)
      if entry.position is not None:
        self._replay.setdefault(entry.worker, []).append(entry.position)
