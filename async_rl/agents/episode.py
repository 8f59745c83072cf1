"""An agent's episode, assembled from its requests into one trajectory.

The episode's tokens are the exact ids the generator saw and produced: the first
request's prompt, then for each turn the tokens generated (policy tokens, with their
behaviour log-probs and versions) and the tokens the agent sent before the next turn
(environment tokens: version -1, masked out of the loss). They are never re-derived
from the agent's text, so what is trained is what was sampled.

A later request must continue the episode:
  * a completion request's prompt ids must begin with the episode's ids; what follows
    them is the environment's turn;
  * a chat request's messages must begin with the previous request's messages and the
    reply the endpoint gave (compared as `wire.same_message` compares them), with the
    same tools; the environment's turn is what the chat template renders after that
    reply: the template's own tokens that close the reply (`reply_glue`), then the
    new messages and the generation prompt.
An agent that edits an earlier turn (or a template that renders the history other than
as it rendered it before) breaks this; the episode is then lost (`EpisodeLost`,
"mismatch") and never trained on. So is an episode whose tokens, generated and sent
back together, would pass its budget ("budget").

Each turn is one request of the workflow's `generate` that holds its slot, and the
next turn continues in that slot (`tasks.workflow`), so the generator prefills only
the environment's tokens.
"""

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Optional

import numpy as np

from async_rl.agents import wire
from async_rl.trajectory import Trajectory

# Why an episode was lost; each is counted (`Endpoint.metrics`).
LOSSES = ("mismatch", "budget", "malformed", "aborted", "crashed", "deadline", "no_turn",
          "bad_reward")


class EpisodeLost(Exception):
  """The episode cannot be trained on; `reason` is one of `LOSSES`."""

  def __init__(self, reason: str, message: str):
    super().__init__(message)
    self.reason = reason


def reply_glue(reply_ids: Sequence[int], generated: Sequence[int],
               stop_ids: Sequence[int]) -> list[int]:
  """The tokens a chat template writes after a reply's generated tokens, before the
  next message: given `reply_ids`, the template's rendering of the reply turn (from its
  generation prompt on), they are what follows `generated` when it is a prefix; else
  what follows the last copy of the reply's final token (a stop token, retokenized
  content before it); else, for a reply that ended without a stop token the template
  writes, the template's last stop token on; else nothing."""
  reply_ids, generated = list(reply_ids), list(generated)
  if reply_ids[:len(generated)] == generated:
    return reply_ids[len(generated):]
  if generated and generated[-1] in reply_ids:
    return reply_ids[len(reply_ids) - reply_ids[::-1].index(generated[-1]):]
  stops = [i for i, t in enumerate(reply_ids) if t in stop_ids]
  return reply_ids[stops[-1]:] if stops else []


class Episode:
  """The tokens of one episode so far, and the slot that holds it between turns.

  Args:
    key: the episode's key (its URL path segment).
    generate: the group's `tasks.workflow.Generate`, which samples as the run does.
    budget: the most tokens after the first prompt.
    stop_ids: the tokenizer's stop ids (a reply ends at one).
  """

  def __init__(self, key: str, generate, *, budget: int, stop_ids: Sequence[int]):
    self.key, self.budget = key, budget
    self._generate, self._stop_ids = generate, tuple(stop_ids)
    self._lock = threading.Lock()
    self._tokens: list[np.ndarray] = []
    self._logp: list[np.ndarray] = []
    self._versions: list[np.ndarray] = []
    self.prompt_len = 0
    self.turns = 0
    self.finish: Optional[str] = None
    self.lost: Optional[EpisodeLost] = None
    self.busy = False
    self._slot = None
    self._closed = False
    self._last_generated: list[int] = []
    # After a chat turn: its messages and tools, the prompt text, and the text of the
    # conversation with the reply (no generation prompt).
    self._chat: Optional[tuple[list, Any, str, str]] = None

  @property
  def ids(self) -> np.ndarray:
    return np.concatenate(self._tokens) if self._tokens else np.zeros(0, np.int32)

  def lose(self, reason: str, message: str) -> EpisodeLost:
    """Marks the episode lost (the first reason stands) and returns the loss."""
    with self._lock:
      if self.lost is None:
        self.lost = EpisodeLost(reason, f"episode {self.key}: {message}")
      return self.lost

  def check(self) -> None:
    """Raises the episode's loss, if lost."""
    if self.lost is not None:
      raise self.lost

  def env_of_tokens(self, prompt_ids: Sequence[int]) -> list[int]:
    """The environment's tokens of a completion request whose prompt is `prompt_ids`."""
    if not self.turns:
      return list(prompt_ids)
    ids = self.ids
    if len(prompt_ids) < ids.size or not np.array_equal(prompt_ids[:ids.size], ids):
      raise self.lose("mismatch", "the prompt does not begin with the episode so far (the "
                      "prompt and every completion, token for token)")
    return list(prompt_ids[ids.size:])

  def env_of_chat(self, messages: list, tools, text: str, encode: Callable) -> list[int]:
    """The environment's tokens of a chat request of `messages` and `tools`, whose
    prompt the template renders as `text` (see the module docstring)."""
    if not self.turns:
      return list(encode(text))
    if self._chat is None:
      raise self.lose("mismatch", "a chat request continues an episode of completions")
    before, before_tools, prompt_text, rendered = self._chat
    if tools != before_tools or len(messages) <= len(before) or not all(
        wire.same_message(a, b) for a, b in zip(before, messages)):
      raise self.lose("mismatch", "the messages do not begin with the earlier messages and "
                      "the replies given to them")
    if not text.startswith(rendered) or not rendered.startswith(prompt_text):
      raise self.lose("mismatch", "the chat template renders the earlier turns differently "
                      "now")
    glue = reply_glue(encode(rendered[len(prompt_text):]), self._last_generated,
                      self._stop_ids)
    return glue + list(encode(text[len(rendered):]))

  def turn(self, env: Sequence[int], max_tokens: Optional[int], stop_ids: Sequence[int],
           on_tokens: Optional[Callable] = None) -> Future:
    """Appends the environment's tokens and submits the next policy turn; the future
    gives [its Trajectory] (whose tokens are the episode's, then the turn's), and
    `on_tokens` its tokens as they are decoded (`generation.Request.on_tokens`)."""
    env_E = np.asarray(env, np.int32)
    with self._lock:
      first = not self.turns
      used = 0 if first else sum(t.size for t in self._tokens) - self.prompt_len
      if not first and used + env_E.size >= self.budget:
        lost = self.lost or EpisodeLost(
            "budget", f"episode {self.key}: {used} tokens and {env_E.size} more reach its "
            f"budget of {self.budget}")
        self.lost = lost
        raise lost
      self._append(env_E)
      if first:
        self.prompt_len = env_E.size
      room = self.budget - (used + (0 if first else env_E.size))
      slot, self._slot = self._slot, None
    if slot is not None and not env_E.size:  # nothing to extend with: start afresh
      self._generate.release(slot)
      slot = None
    return self._generate(self.ids, 1, max_new_tokens=min(room, max_tokens or room),
                          stop_ids=(*self._stop_ids, *stop_ids), hold_slot=True, slot=slot,
                          on_tokens=on_tokens)

  def record(self, turn: Trajectory, kept: Optional[int] = None) -> None:
    """Appends a turn's generated tokens, from the `Trajectory` `turn` gave.

    Args:
      turn: the turn's sample.
      kept: how many of its generated tokens the agent was given, when a stop string
        ended the reply before the generator did; the tokens after it, which the agent
        never saw, are dropped from the episode, and the slot whose cache holds them is
        freed (the next turn prefills the episode afresh). None: all of them.
    """
    P, C = turn.prompt_len, len(turn.completion_C)
    finish = turn.finish_reason if kept is None else "stop"
    kept = C if kept is None else kept
    with self._lock:
      slot = turn.metadata.get("slot")
      if slot is not None and (self._closed or kept < C):
        self._generate.release(slot)
        slot = None
      if self._closed:
        return
      self._slot = slot
      self._last_generated = [int(t) for t in turn.completion_C[:kept]]
      self._append(turn.completion_C[:kept], turn.logp_T[P:P + kept],
                   turn.versions_T[P:P + kept])
      self.turns += 1
      self.finish = finish
    if turn.finish_reason == "aborted":
      self.lose("aborted", "a turn was aborted")

  def replied(self, messages: list, tools, prompt_text: str, rendered: str) -> None:
    """Remembers a chat turn: its messages with the reply, tools and texts."""
    self._chat = (messages, tools, prompt_text, rendered)

  def completed(self) -> None:
    """Remembers that the last turn was a completion request."""
    self._chat = None

  def close(self) -> None:
    """Frees the held slot; a turn still running frees its own when it ends."""
    with self._lock:
      self._closed = True
      slot, self._slot = self._slot, None
    if slot is not None:
      self._generate.release(slot)

  def trajectory(self, reward: float) -> Trajectory:
    """The episode as one sample with `reward`; raises its loss if it was lost."""
    self.check()
    if not self.turns:
      raise self.lose("no_turn", "the agent made no request")
    versions_T = np.concatenate(self._versions)
    return Trajectory(tokens_T=self.ids, loss_mask_T=versions_T >= 0,
                      logp_T=np.concatenate(self._logp), versions_T=versions_T,
                      prompt_len=self.prompt_len, finish_reason=self.finish, reward=reward,
                      metadata={"turns": self.turns, "episode": self.key})

  def _append(self, tokens, logp=None, versions=None):
    tokens = np.asarray(tokens, np.int32)
    self._tokens.append(tokens)
    self._logp.append(np.zeros(tokens.size, np.float32) if logp is None
                      else np.asarray(logp, np.float32))
    self._versions.append(np.full(tokens.size, -1, np.int32) if versions is None
                          else np.asarray(versions, np.int32))
