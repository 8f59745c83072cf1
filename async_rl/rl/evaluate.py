"""Held-out evaluation: greedy accuracy and pass@k through a generator pool (`evaluate`),
and the `Evaluator` a run keeps for its evaluations."""

from concurrent.futures import Future
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from async_rl.config import EvalConfig
from async_rl.generation import GeneratorPool, Request, SamplingParams
from async_rl.rewards import RewardTask
from async_rl.rl.episodes import EpisodeRunner


def evaluate(pool: GeneratorPool, prompts: Sequence, *,
             score: Callable[[Sequence[tuple[object, str]]], Sequence[float]],
             decode: Callable, max_new_tokens: int, stop_token_ids: Sequence[int],
             pass_k: int, seed: int = 0, workflow=None,
             vocab_size: Optional[int] = None, correct_threshold: float = 1.0,
             also_scores: Optional[Mapping[str, Callable]] = None,
             wait: Callable[[Future], Any] = Future.result) -> dict[str, float]:
  """Greedy accuracy, pass@k (k samples at temperature 1; none when `pass_k` is 0) and
  mean completion length.

  `score([(prompt, completion_text), ...])` returns each completion's score (the run
  scores through its reward service, so a failing call counts 0). A completion is
  correct when its score is at least `correct_threshold` (`eval.correct_threshold`),
  so with the default 1.0 partial credit from a shaped reward (`step_credit`) never
  counts. Each of `also_scores` (name -> a function like `score`) scores the greedy
  completions too, its accuracy reported as `accuracy_NAME`. Uses the pool's current
  weights; requests are tagged `eval/...` so they never mix with training requests.
  Each prompt's samples come from the task's `workflow` (None: single-turn), so a
  completion is a whole episode.
  `wait(future)` returns a request's samples (the run waits with its deadlines).
  """
  greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                          stop_token_ids=stop_token_ids, seed=seed)
  sampled = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens,
                           stop_token_ids=stop_token_ids, seed=seed)
  runner = EpisodeRunner(pool, workflow, vocab_size=vocab_size)
  try:
    greedy_f = [runner.submit(p, Request(f"eval/greedy/{i}", list(p.tokens), 1, greedy))
                for i, p in enumerate(prompts)]
    sampled_f = [runner.submit(p, Request(f"eval/pass/{i}", list(p.tokens), pass_k, sampled))
                 for i, p in enumerate(prompts) if pass_k]
    greedy_samples = [wait(f)[0] for f in greedy_f]
    sampled_samples = [wait(f) for f in sampled_f]
  finally:
    runner.close()
  greedy_pairs = [(p, decode(s.completion_C)) for p, s in zip(prompts, greedy_samples)]
  scores = {"accuracy": score, **{f"accuracy_{k}": f for k, f in (also_scores or {}).items()}}
  accuracy = {name: float(np.mean(np.greater_equal(fn(greedy_pairs), correct_threshold)))
              for name, fn in scores.items()}
  if pass_k:
    sampled = [(p, decode(x.completion_C)) for p, xs in zip(prompts, sampled_samples) for x in xs]
    passed = np.reshape(np.greater_equal(score(sampled), correct_threshold),
                        (len(prompts), pass_k)).max(axis=1)
    accuracy[f"pass_at_{pass_k}"] = float(np.mean(passed))
  lengths = [len(s.completion_C) for s in greedy_samples]
  return {**accuracy, "completion_len": float(np.mean(lengths))}


class Evaluator:
  """Held-out metrics of successive params, through one generator pool and one reward
  service kept open, so that an evaluation compiles nothing after the first.

  Args:
    pool: the held-out `GeneratorPool` (its engine may be the rollout worker's).
    rewards: a `RewardService` that scores the completions.
    task: the task (its held-out prompts, reference, tokenizer and workflow).
    cfg: how many prompts, k of pass@k, and the score a correct completion reaches.
    reward_fn: the function (or its name) scoring a completion's correctness (the
      builder's `correct_fn`).
    also_correct: more functions (or names) scoring correctness, by name: their greedy
      accuracies are reported as `accuracy_NAME` (the builder's `also_correct_fns`).
    max_new_tokens: the generation budget of a completion.
    seed: the sampling seed.
    vocab_size: the model's vocabulary (a workflow's tokens must lie in it).
    max_prompt_len: longer held-out prompts are left out (and counted, "too_long"),
      as the rollouts leave them out of training.
    wait: `wait(future, what)` returns a future's result; the run waits with its
      deadlines, naming `what`. None: `future.result()`, without a deadline.
  """

  def __init__(self, pool: GeneratorPool, rewards, task, cfg: EvalConfig, *,
               reward_fn, max_new_tokens: int,
               also_correct: Optional[Mapping[str, Any]] = None, seed: int = 0,
               vocab_size: Optional[int] = None, max_prompt_len: Optional[int] = None,
               wait: Optional[Callable[[Future, str], Any]] = None):
    self.pool, self.rewards, self.task, self.cfg = pool, rewards, task, cfg
    self._reward_fn, self._max_new_tokens = reward_fn, max_new_tokens
    self._also_correct = dict(also_correct or {})
    self._seed, self._vocab_size = seed, vocab_size
    self._wait = wait or (lambda future, _: future.result())
    self._max_prompt_len = max_prompt_len

  def load(self, params, version: int) -> None:
    """Makes `params` (at `version`) the ones evaluated, unless they already are."""
    if version > self.pool.version:
      self._wait(self.pool.update_weights(params, version, "keep"),
                 "the held-out generator's weight update")

  def evaluate(self, prompts: Optional[Sequence] = None, pass_k: Optional[int] = None
               ) -> dict[str, Any]:
    """`evaluate` of the loaded params on `prompts` (default: the task's first
    `cfg.num_prompts` held-out prompts) with `pass_k` (default `cfg.pass_k`), and the
    reward service's counters since it started (`rewards`: calls, errors, timeouts,
    ..., as a rollout worker's), so that a failing reward is seen here too."""
    task = self.task
    prompts = task.heldout(self.cfg.num_prompts) if prompts is None else prompts
    fitting = [p for p in prompts
               if self._max_prompt_len is None or len(p.tokens) <= self._max_prompt_len]

    def scorer(reward_fn):
      def score(pairs):
        futures = [self.rewards.submit(RewardTask(reward_fn, text, task.reference(p)))
                   for p, text in pairs]
        return [self._wait(f, "held-out rewards") for f in futures]
      return score

    metrics = evaluate(
        self.pool, fitting, score=scorer(self._reward_fn), decode=task.tokenizer.decode,
        max_new_tokens=self._max_new_tokens, stop_token_ids=task.tokenizer.stop_ids,
        pass_k=self.cfg.pass_k if pass_k is None else pass_k, seed=self._seed,
        workflow=task.workflow, vocab_size=self._vocab_size,
        correct_threshold=self.cfg.correct_threshold,
        also_scores={name: scorer(fn) for name, fn in self._also_correct.items()},
        wait=lambda f: self._wait(f, "held-out generation"))
    return {**metrics, "too_long": len(prompts) - len(fitting), "rewards": self.rewards.metrics()}

  def close(self) -> None:
    """Shuts the pool and the reward service down."""
    self.pool.shutdown()
    self.rewards.close()
