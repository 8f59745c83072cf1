"""Held-out evaluation: greedy accuracy and pass@k through a generator pool."""

from typing import Callable, Optional, Sequence

import numpy as np

from async_rl.generation import GeneratorPool, Request, SamplingParams
from async_rl.rl.episodes import EpisodeRunner


def evaluate(pool: GeneratorPool, prompts: Sequence, *,
             score: Callable[[Sequence[tuple[object, str]]], Sequence[float]],
             decode: Callable, max_new_tokens: int, stop_token_ids: Sequence[int],
             pass_k: int, seed: int = 0, workflow=None,
             vocab_size: Optional[int] = None) -> dict[str, float]:
  """Greedy accuracy, pass@k (k samples at temperature 1) and mean completion length.

  `score([(prompt, completion_text), ...])` returns each completion's reward (the run
  scores through its reward service, so a failing reward counts 0). A completion is
  correct when its reward is at least 1.0, so partial credit from a shaped reward
  (`step_credit`) never counts. Uses the pool's current weights; requests are tagged
  `eval/...` so they never mix with training requests. Each prompt's samples come
  from the task's `workflow` (None: single-turn), so a completion is a whole episode.
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
                 for i, p in enumerate(prompts)]
    greedy_samples = [f.result()[0] for f in greedy_f]
    sampled_samples = [f.result() for f in sampled_f]
  finally:
    runner.close()
  correct = np.greater_equal(
      score([(p, decode(s.completion_C)) for p, s in zip(prompts, greedy_samples)]), 1.0)
  sampled = [(p, decode(x.completion_C)) for p, xs in zip(prompts, sampled_samples) for x in xs]
  passed = np.reshape(np.greater_equal(score(sampled), 1.0), (len(prompts), pass_k)).max(axis=1)
  lengths = [len(s.completion_C) for s in greedy_samples]
  return {"accuracy": float(np.mean(correct)), f"pass_at_{pass_k}": float(np.mean(passed)),
          "completion_len": float(np.mean(lengths))}
