"""The agent task (`task.name="agent"`): a user's agent, written for the `openai` client,
trained as it is.

`task.agent.episode` names `async def episode(client, row) -> float`. For each member
of a prompt group the run opens an episode on its endpoint (`agents.server`), hands
the agent an `openai.AsyncOpenAI` client whose base URL is that episode's, and the
row of the task `task.agent.task` that the prompt came from (what the task's
`reference` gives: an arithmetic `Problem`, a data set `Row`); the agent calls the
model as often as it likes, calls its tools, and returns the episode's reward. Every
group's agents run concurrently on one event loop (a thread of the workflow's),
sharing one HTTP client, each under a deadline (`task.agent.deadline_s`); an agent
must not block the loop (blocking work goes to `asyncio.to_thread`).

Each episode becomes one trajectory (`agents.episode`): the exact tokens generated,
with their behaviour log-probs and versions, and the tokens the agent sent between
turns, masked; its reward is the agent's return value, so the reward service is not
called. An episode that cannot be trained on is lost: the agent raised, passed its
deadline, sent a malformed request, edited an earlier turn, passed its token budget
or returned something that is not a number. A lost episode is counted and logged, and
comes back as an "aborted" sample of its prompt alone, with reward 0: the rollout
controller rejects a group with an aborted sample, as it does any (which frees its
capacity), and held-out evaluation scores it wrong; the run goes on.

Held-out accuracy runs the agent on the held-out prompts (greedy) and scores each
episode's transcript (every token after the first prompt) with the inner task's reward
function, as for any multi-turn task.
"""

import asyncio
import collections
import dataclasses
import inspect
import logging
import numbers
import threading
from collections.abc import Callable
from typing import Any, Optional

from async_rl import named
from async_rl.agents.episode import LOSSES, Episode, EpisodeLost
from async_rl.agents.server import Endpoint
from async_rl.config import TaskConfig
from async_rl.tasks import registry
from async_rl.trajectory import Trajectory

_CLOSE_TIMEOUT_S = 10.0


class AgentWorkflow:
  """Runs the agent once per group member against the endpoint (`tasks.workflow`).

  Args:
    endpoint: the endpoint the episodes are opened on; started on first use.
    agent: `async def episode(client, row) -> float`.
    row: a prompt -> the row the agent is given.
    deadline_s: an episode still running after this long is cancelled and lost.
    max_tokens: each episode's budget of tokens after its first prompt; None: the
      group's `max_new_tokens`.
    api_key: the endpoint's bearer token, for the clients.
  """

  def __init__(self, endpoint: Endpoint, agent: Callable, *, row: Callable[[Any], Any],
               deadline_s: float, max_tokens: Optional[int] = None,
               api_key: Optional[str] = None):
    self.endpoint, self._agent, self._row = endpoint, agent, row
    self._deadline_s, self._max_tokens, self._api_key = deadline_s, max_tokens, api_key
    self._lock = threading.Lock()
    self._counts: collections.Counter = collections.Counter()
    self._loop: Optional[asyncio.AbstractEventLoop] = None
    self._thread: Optional[threading.Thread] = None
    self._client = None  # one HTTP client for all agents, made and used on `_loop`

  def metrics(self) -> dict[str, int]:
    """Episodes run (`agent_episodes`) and those lost, by reason (`agent_lost_<reason>`
    for each of `agents.episode.LOSSES`, zeros included), for the metrics log."""
    with self._lock:
      return {"agent_episodes": self._counts["episodes"],
              **{f"agent_lost_{r}": self._counts[f"lost_{r}"] for r in LOSSES}}

  def close(self) -> None:
    """Cancels the agents still running, closes the HTTP client, stops the agents'
    event loop, within `_CLOSE_TIMEOUT_S`, and closes the endpoint. A later `run`
    starts them again."""
    with self._lock:
      loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
    if loop is not None:
      self._stop(loop, thread)
    self.endpoint.close()

  def _stop(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    try:
      asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(_CLOSE_TIMEOUT_S)
    except (TimeoutError, RuntimeError) as e:  # an agent that ignores its cancellation
      logging.warning("the agents' event loop did not shut down cleanly: %r", e)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(_CLOSE_TIMEOUT_S)
    if not thread.is_alive():
      loop.close()

  async def _shutdown(self) -> None:
    # A task still pending when the loop stops is destroyed with a warning, and so is
    # the task that finalizes an async generator (a stream's) collected after it: cancel
    # and await the agents, close the client's connections and the generators, first.
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
      t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    client, self._client = self._client, None
    if client is not None:
      await client.close()
    await asyncio.get_running_loop().shutdown_asyncgens()

  def _agents_loop(self) -> asyncio.AbstractEventLoop:
    # One loop for every group's agents: a client per loop shares its connections, and
    # no group pays for a loop and a client of its own.
    with self._lock:
      if self._loop is None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="agents",
                                        daemon=True)
        self._thread.start()
      return self._loop

  def run(self, prompt, n: int, generate) -> list:
    self.endpoint.start()
    budget = self._max_tokens or generate.max_new_tokens
    episodes = [self.endpoint.open(generate, budget=budget) for _ in range(n)]
    try:
      outcomes = asyncio.run_coroutine_threadsafe(
          self._run_agents(episodes, self._row(prompt)), self._agents_loop()).result()
    finally:
      for episode in episodes:
        self.endpoint.finish(episode)
    trajectories, lost = [], []
    for episode, outcome in zip(episodes, outcomes):
      try:
        trajectories.append(episode.trajectory(self._reward(episode, outcome)))
      except EpisodeLost as e:
        lost.append(e)
        trajectories.append(Trajectory.from_completion(
            prompt.tokens, [], [], [], "aborted", reward=0.0,
            metadata={"episode": episode.key, "lost": e.reason}))
    with self._lock:
      self._counts["episodes"] += n
      self._counts.update(f"lost_{e.reason}" for e in lost)
      counts = dict(self._counts)
    for e in lost:
      logging.warning("agent episode lost (%s): %s; so far %s", e.reason, e, counts)
    return trajectories

  async def _run_agents(self, episodes: list[Episode], row) -> list:
    if self._client is None:
      import openai  # noqa: PLC0415 - the `agents` extra
      # Retries resend a request whose connection failed before the endpoint read it (a
      # kept-alive connection closed under it). A resent request that the endpoint had
      # served no longer continues its episode, which is lost as a mismatch: nothing
      # is trained twice.
      self._client = openai.AsyncOpenAI(base_url=self.endpoint.url, max_retries=2,
                                        api_key=self._api_key or "unused",
                                        timeout=self._deadline_s)

    async def one(episode):
      client = self._client.with_options(base_url=self.endpoint.episode_url(episode))
      try:
        return await asyncio.wait_for(self._agent(client, row), self._deadline_s)
      except TimeoutError:
        raise episode.lose("deadline", f"the agent ran past its deadline of "
                           f"{self._deadline_s:g} s") from None

    return await asyncio.gather(*(one(e) for e in episodes), return_exceptions=True)

  @staticmethod
  def _reward(episode: Episode, outcome) -> float:
    if isinstance(outcome, BaseException):
      raise episode.lose("crashed", f"the agent raised {type(outcome).__name__}: {outcome}")
    if isinstance(outcome, bool) or not isinstance(outcome, numbers.Real):
      raise episode.lose("bad_reward", f"the agent returned {outcome!r}, not a number")
    return float(outcome)


@dataclasses.dataclass
class AgentTask:
  """The task `inner` (its prompts, rows, held-out set, tokenizer, reward function and,
  where it has them, warm-start examples), with episodes run by the agent
  (`workflow`)."""
  inner: Any
  workflow: AgentWorkflow

  @property
  def tokenizer(self):
    return self.inner.tokenizer

  @property
  def reward_fn(self):
    return self.inner.reward_fn

  def stream(self, state: Optional[dict] = None, *, worker_index: int = 0):
    return self.inner.stream(state, worker_index=worker_index)

  def heldout(self, n: int):
    return self.inner.heldout(n)

  def reference(self, prompt):
    return self.inner.reference(prompt)


def load_agent(name: str) -> Callable:
  """The agent function `task.agent.episode` names; raises ValueError if it does not
  load or is not an `async def`."""
  agent = named.load_named(name, "task.agent.episode", "agent function") if name else None
  if agent is None:
    raise ValueError(f"task.agent.episode must be 'module:function' naming "
                     f"`async def episode(client, row) -> float`, got {name!r}")
  if not inspect.iscoroutinefunction(agent):
    raise ValueError(f"task.agent.episode {name!r} must be an `async def` function")
  return agent


def _inner_config(cfg: TaskConfig) -> TaskConfig:
  return dataclasses.replace(cfg, name=cfg.agent.task)


def make(cfg: TaskConfig) -> AgentTask:
  inner = registry.make_task(_inner_config(cfg))
  endpoint = Endpoint(inner.tokenizer, host=cfg.agent.host, port=cfg.agent.port,
                      api_key=cfg.agent.api_key, add_bos=cfg.agent.add_bos)
  workflow = AgentWorkflow(endpoint, load_agent(cfg.agent.episode), row=inner.reference,
                           deadline_s=cfg.agent.deadline_s, max_tokens=cfg.agent.max_tokens,
                           api_key=cfg.agent.api_key)
  task = AgentTask(inner, workflow)
  if hasattr(inner, "sft_examples"):  # a warm start reads the task's own examples
    task.sft_examples = inner.sft_examples
  return task


def check(cfg) -> None:
  """The inner task's checks, and that the agent function loads."""
  registry.check_task(dataclasses.replace(cfg, task=_inner_config(cfg.task)))
  load_agent(cfg.task.agent.episode)
