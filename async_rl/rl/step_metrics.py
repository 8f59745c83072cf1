"""A training step's metrics and the lines that show them: pure functions of what the
trainer loop's parts count (`rl.trainer_loop`).

`step_metrics` turns the trainer's own metrics, the batch and the counters of the
parameter server, the rollout workers and their reward services into the step's log
line, its rates and increments taken from the counters as the previous step left them
(`Since`). `step_line` and `eval_line` are the one-line summaries a run prints;
`samples` the completions its log shows; `skip_cause` and `untrainable_cause` say why a
step was skipped, or why no group could be trained.
"""

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from async_rl.config import LogConfig
from async_rl.param_server.buffer import length_summary
from async_rl.trajectory import Group


@dataclasses.dataclass(frozen=True)
class Since:
  """The counters as the previous step left them: a step's rates and increments are
  taken from them."""
  time: float
  staleness_hist: np.ndarray
  gen_tokens: int = 0
  reward_calls: int = 0
  reward_failures: int = 0
  restarts: int = 0


def step_metrics(train: dict, groups: Sequence[Group], *, server: dict, lengths: dict,
                 workers: Sequence[dict], since: Since, now: float, time_wait_s: float,
                 time_publish_s: float, time_record_s: float, skipped_steps: int,
                 applied_updates: int, learning_rate: Callable[[int], float],
                 correct_threshold: float, longest_unreported_wait_s: float
                 ) -> tuple[dict[str, Any], Since]:
  """A training step's metrics, and the counters the next step's are taken from.

  Args:
    train: the step's own metrics (`Trainer.train`).
    groups: the batch it trained.
    server: the parameter server's counters now (`ParameterServer.metrics`), which
      counted the batch's tokens by staleness when it handed the batch out.
    lengths: the server's completion-length histograms.
    workers: each rollout worker's metrics now (`RolloutWorker.metrics`).
    since: the counters as the previous step left them.
    now: the time (`time.perf_counter`) the counters were read.
    time_wait_s, time_publish_s, time_record_s: what the step waited for its batch, its
      publish and its record took.
    skipped_steps, applied_updates: the run's counts, this step included.
    learning_rate: the learning rate by applied update.
    correct_threshold: a reward of at least this counts as correct (`accuracy`).
    longest_unreported_wait_s: the deadlines' longest wait not yet reported.

  Returns:
    The metrics: the same names whatever the number of rollout workers; `rollout` and
    `rewards` add up every worker's counters, and `workers` holds each worker's own by
    its index ("0", "1", ...).
  """
  hist = np.asarray(server["staleness_hist"], np.int64)
  counts = hist - np.pad(since.staleness_hist, (0, hist.size - since.staleness_hist.size))
  rewards = np.array([t.reward for g in groups for t in g.trajectories])
  rollout = {k: sum(w["rollout"][k] for w in workers) for k in workers[0]["rollout"]}
  reward_calls = _reward_totals([w["rewards"] for w in workers])
  failures = int(reward_calls["errors"] + reward_calls["timeouts"])
  counted = Since(now, hist, gen_tokens=rollout["generated_tokens"],
                  reward_calls=int(reward_calls["calls"]), reward_failures=failures,
                  restarts=sum(w.get("restarts", 0) for w in workers))
  metrics = {
      **train, **_staleness(counts),
      "lr": float(learning_rate(max(applied_updates - 1, 0))),
      "reward_mean": float(rewards.mean()),
      "accuracy": float((rewards >= correct_threshold).mean()),
      "time_wait_s": time_wait_s, "time_publish_s": time_publish_s,
      "time_record_s": time_record_s,
      "skipped_steps": skipped_steps, "updates": applied_updates,
      "train_tokens_per_s": train["trained_tokens"] / max(train["time_train_s"], 1e-9),
      "gen_tokens_per_s": (counted.gen_tokens - since.gen_tokens) / (now - since.time),
      "reward_error_rate": ((counted.reward_failures - since.reward_failures)
                            / max(counted.reward_calls - since.reward_calls, 1)),
      "prompts": [str(g.prompt_id) for g in groups],
      "longest_unreported_wait_s": longest_unreported_wait_s,
      "worker_restarts": counted.restarts,
      "lengths": {k: length_summary(h) for k, h in lengths.items()},
      "server": {k: v for k, v in server.items() if k != "staleness_hist"},
      "rollout": rollout, "rewards": reward_calls,
      "workers": {str(i): w for i, w in enumerate(workers)}}
  return metrics, counted


def _reward_totals(services: Sequence[dict]) -> dict[str, float]:
  """Reward services' counters added up; their mean latency weighted by calls."""
  calls = sum(s["calls"] for s in services)
  totals = {k: sum(s[k] for s in services) for k in services[0] if k != "mean_latency_s"}
  totals["mean_latency_s"] = (sum(s["mean_latency_s"] * s["calls"] for s in services)
                              / calls if calls else 0.0)
  return totals


def _staleness(counts) -> dict:
  """A batch's staleness metrics from `counts[k]`, its trained tokens of staleness k."""
  tokens = int(counts.sum())
  return {"staleness_mean": float(np.arange(counts.size) @ counts) / max(tokens, 1),
          "staleness_max": int(np.flatnonzero(counts)[-1]) if tokens else 0,
          "staleness_hist": {k: int(c) for k, c in enumerate(counts) if c}}


def skip_cause(metrics, groups) -> str:
  """What was not finite: the loss, the gradient norm, and any bad inputs."""
  parts = [f"loss={metrics['loss']:.4g} grad_norm={metrics['grad_norm']:.4g}"]
  trajs = [t for g in groups for t in g.trajectories]
  bad_logp = sum(int(np.count_nonzero(~np.isfinite(t.logp_T[t.loss_mask_T]))) for t in trajs)
  bad_reward = sum(not np.isfinite(t.reward) for t in trajs)
  if bad_logp:
    parts.append(f"{bad_logp} non-finite behaviour log-probs")
  if bad_reward:
    parts.append(f"{bad_reward} non-finite rewards")
  return ", ".join(parts)


def eval_line(version, m) -> str:
  """The one-line summary of a held-out evaluation: its scores, and failed reward calls."""
  scores = " ".join(f"{k}={v:.3f}" for k, v in m.items() if not isinstance(v, dict))
  failed = {k: int(m["rewards"][k]) for k in ("errors", "timeouts") if m["rewards"][k]}
  return f"eval v={version}: {scores}" + "".join(f" reward_{k}={n}" for k, n in failed.items())


def step_line(version, m) -> str:
  """The one-line summary of a training step (`step_metrics`' metrics)."""
  return (f"v={version} reward={m['reward_mean']:.3f} acc={m['accuracy']:.3f} "
          f"stale={m['staleness_mean']:.2f}/{m['staleness_max']} "
          f"gen={m['gen_tokens_per_s']:.0f}tok/s train={m['train_tokens_per_s']:.0f}tok/s "
          f"wait={m['time_wait_s']:.2f}s update={m['time_train_s']:.2f}s "
          f"publish={m['time_publish_s']:.2f}s loss={m['loss']:.4f} "
          f"logp_mismatch={m['mismatch_abs_max']:.1e} lr={m['lr']:.3g} "
          f"reward_err={m['reward_error_rate']:.2f}")


def untrainable_cause(n, limit, server, workers) -> str:
  """Why `n` groups in a row could not be trained, from the counts so far."""
  counts = {k: sum(w["rollout"][k] for w in workers) for k in ("too_long", "failed", "filtered")}
  reasons = [f"{counts['too_long']} had prompts longer than task.max_prompt_len",
             f"{counts['failed']} failed to generate or score",
             f"{counts['filtered']} were filtered as all rewards equal "
             f"(rollout.dynamic_filter)",
             f"{server['dropped']} were dropped as staler than staleness.max_staleness"]
  return (f"{n} groups in a row finished and none could be trained (run."
          f"max_untrainable_groups={limit}); of all groups so far, {'; '.join(reasons)}")


def samples(groups: Sequence[Group], decode, log_cfg: LogConfig,
             correct_threshold: float) -> list[dict]:
  """The first `log_cfg.num_samples` completions of a batch, with their prompts and
  rewards, as text cut to `log_cfg.sample_chars`."""
  trajs = [(g.prompt_id, t) for g in groups for t in g.trajectories][:log_cfg.num_samples]
  clip = lambda ids: _clip(decode([int(i) for i in ids]), log_cfg.sample_chars)
  return [{"prompt_id": str(prompt_id), "reward": float(t.reward),
           "correct": bool(t.reward >= correct_threshold), "finish_reason": t.finish_reason,
           "prompt": clip(t.prompt_P), "completion": clip(t.completion_C)}
          for prompt_id, t in trajs]


def _clip(text: str, limit: int) -> str:
  """`text`, or when longer than `limit` its beginning and end around a count of the
  characters cut: a prompt's question is at its end, a completion's answer too."""
  if len(text) <= limit:
    return text
  keep = limit - len(_cut(len(text)))  # the count of those cut has no more digits
  return text[:keep // 2] + _cut(len(text) - keep) + text[len(text) - (keep - keep // 2):]


def _cut(n: int) -> str:
  return f" [...{n} characters...] "
