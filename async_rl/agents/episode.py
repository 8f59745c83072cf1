"""An agent's episode, assembled from its requests into one trajectory.

The episode's tokens are the exact ids the generator saw and produced: the first
request's prompt, then for each turn the tokens generated (policy tokens, with their
behaviour log-probs and versions) and the tokens the agent sent before the next turn
(environment tokens: version -1, masked out of the loss). What the agent sends back is
never retokenized into the episode: a reply's own ids stand for it, so what is trained
is what was sampled, whatever its text decodes to (special tokens, which the text
leaves out, or ids the tokenizer cannot write, which it shows as U+FFFD).

A later request must continue the episode:
  * a completion request's prompt text must begin with the episode's text so far (its
    first prompt's text, then each reply's text as its tokens decode, the stop string
    included, and each environment text the agent sent), or its prompt ids (a text's
    ids, or ids as sent: `prompt_token_ids` and `token_ids` of the replies given, say)
    must begin with the episode's ids; what follows is the environment's turn;
  * a chat request's messages must begin with the previous request's messages and the
    reply the endpoint gave (compared as `wire.same_message` compares them: an
    assistant message may carry the reply's `token_ids`, which must then be the ids
    generated), with the same tools; the prompt is the conversation with each reply as
    its ids (`conversation_ids`), and the environment's turn is what follows the
    episode's ids in it: the template's own tokens that close the reply
    (`reply_glue`), then the new messages and the generation prompt.
An agent that edits an earlier turn (or a template that renders the history other than
as it rendered it before) breaks this; the episode is then lost (`EpisodeLost`,
"mismatch") and never trained on. So is an episode whose tokens, generated and sent
back together, would pass its budget ("budget").

Each turn is one request of the workflow's `generate` that holds its slot, and the
next turn continues in that slot (`tasks.workflow`), so the generator prefills only
the environment's tokens.
"""

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Optional, Union

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


def reply_glue(turn: str, reply: Mapping[str, Any], tok) -> list[int]:
  """The tokens a chat template writes after a reply's generated tokens, before the next
  message.

  Args:
    turn: the template's rendering of the reply (from its generation prompt on).
    reply: the assistant message, with the `token_ids` it was generated as.
    tok: the tokenizer (`encode`, `decode`, `stop_ids`).

  Where `turn` begins with the reply's text (its tokens decoded, or, with no tool calls,
  its content: a stop string leaves the content shorter), the glue is the rest of
  `turn`, less the stop token the reply already ended on. Else, in ids: what follows
  the reply's tokens in `turn`'s ids when they are a prefix; else what follows the last
  copy of the reply's final token (a stop token, retokenized content before it); else
  the template's last stop token on; else nothing.
  """
  generated = list(reply["token_ids"])
  texts = [tok.decode(generated)]
  if not reply.get("tool_calls"):
    texts.append(reply.get("content") or "")
  for text in texts:
    if turn.startswith(text):
      glue = list(tok.encode(turn[len(text):]))
      ended = generated[-1:] if generated and generated[-1] in tok.stop_ids else []
      return glue[len(ended):] if ended and glue[:1] == ended else glue
  reply_ids = list(tok.encode(turn))
  if reply_ids[:len(generated)] == generated:
    return reply_ids[len(generated):]
  if generated and generated[-1] in reply_ids:
    return reply_ids[len(reply_ids) - reply_ids[::-1].index(generated[-1]):]
  stops = [i for i, t in enumerate(reply_ids) if t in tok.stop_ids]
  return reply_ids[stops[-1]:] if stops else []


class TemplateMismatch(ValueError):
  """The chat template does not render a conversation as its turns rendered one by one."""


def conversation_ids(messages: Sequence[Mapping[str, Any]], render: Callable, tok) -> list[int]:
  """The token ids of a chat prompt: `messages` as the template renders them
  (`render(messages, add_generation_prompt)`), up to the generation prompt, where each
  assistant message that carries `token_ids` stands as those ids and the template's
  glue after them (`reply_glue`), not as its text retokenized.

  Raises:
    TemplateMismatch: the template renders a reply other than after the generation
      prompt of the messages before it, or the conversation other than as it rendered
      its earlier turns.
  """
  ids: list[int] = []
  done = ""  # the text `ids` stand for
  for i, m in enumerate(messages):
    if m.get("role") != "assistant" or "token_ids" not in m:
      continue
    before, after = render(messages[:i], True), render(messages[:i + 1], False)
    if not before.startswith(done) or not after.startswith(before):
      raise TemplateMismatch(f"the chat template renders messages[{i}] other than after "
                             f"the generation prompt of the messages before it")
    ids += [*tok.encode(before[len(done):]), *m["token_ids"],
            *reply_glue(after[len(before):], m, tok)]
    done = after
  text = render(messages, True)
  if not text.startswith(done):
    raise TemplateMismatch("the chat template renders the conversation other than as it "
                           "renders its earlier turns")
  return ids + list(tok.encode(text[len(done):]))


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
    # The messages and tools of the chat turn asked (the replies before it carrying
    # their ids), and after it, the same with the reply last.
    self._asked: Optional[tuple[list, Any]] = None
    self._chat: Optional[tuple[list, Any]] = None
    # The episode's text as a completions agent holds it; None once it sent ids.
    self._text: Optional[str] = None

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

  def env_of_completion(self, prompt: Union[str, Sequence[int]], encode: Callable,
                        bos_id: Optional[int]) -> list[int]:
    """The environment's tokens of a completion request whose prompt is `prompt`, its
    text (encoded after `bos_id` unless it is None) or its ids (see the module
    docstring)."""
    text = prompt if isinstance(prompt, str) else None
    if text is not None and self._text is not None and text.startswith(self._text):
      env = list(encode(text[len(self._text):]))
      self._text = text
      return env
    try:
      ids = ([] if bos_id is None else [bos_id]) + list(encode(text)) if text is not None \
          else list(prompt)
    except ValueError as e:  # a text the tokenizer cannot encode
      if not self.turns:
        raise
      raise self.lose("mismatch", f"the prompt does not begin with the episode's text so far, "
                      f"and does not encode ({e})") from None
    self._text = text
    so_far = self.ids
    if self.turns and (len(ids) < so_far.size or not np.array_equal(ids[:so_far.size], so_far)):
      raise self.lose("mismatch", "the prompt begins neither with the episode's text so far "
                      "(the prompt, every reply and every environment text) nor with its "
                      "ids (token for token)")
    return ids[so_far.size:]

  def env_of_chat(self, messages: Sequence[Mapping[str, Any]], tools, render: Callable,
                  tok) -> list[int]:
    """The environment's tokens of a chat request of `messages` and `tools`, which
    `render(messages, add_generation_prompt)` renders with the template, `tok`
    encodes (see the module docstring)."""
    if self.turns:
      if self._chat is None:
        raise self.lose("mismatch", "a chat request continues an episode of completions")
      before, before_tools = self._chat
      if tools != before_tools or len(messages) <= len(before) or not all(
          wire.same_message(a, b) for a, b in zip(before, messages)):
        raise self.lose("mismatch", "the messages do not begin with the earlier messages and "
                        "the replies given to them")
      messages = [*before, *messages[len(before):]]  # the replies as their ids
    self._asked = (messages, tools)
    try:
      ids = conversation_ids(messages, render, tok)
    except TemplateMismatch as e:
      if not self.turns:
        raise
      raise self.lose("mismatch", str(e)) from None
    so_far = self.ids
    if len(ids) < so_far.size or not np.array_equal(ids[:so_far.size], so_far):
      raise self.lose("mismatch", "the chat template renders the earlier turns differently "
                      "now")
    return ids[so_far.size:]

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
      self._append(turn.completion_C[:kept], turn.logp_T[P:P + kept],
                   turn.versions_T[P:P + kept])
      self.turns += 1
      self.finish = finish
    if turn.finish_reason == "aborted":
      self.lose("aborted", "a turn was aborted")

  def replied(self, reply: Mapping[str, Any]) -> None:
    """Remembers a chat turn's `reply`, an assistant message with its `token_ids`."""
    messages, tools = self._asked
    self._chat, self._text = ([*messages, reply], tools), None

  def completed(self, reply: str) -> None:
    """Remembers a completion turn, whose tokens decode to `reply`."""
    self._chat = None
    if self._text is not None:
      self._text += reply

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
