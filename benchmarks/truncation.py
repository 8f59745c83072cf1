r"""Importance ratios under top-p / top-k sampling: the trainer scoring the full softmax
against the truncated distribution the tokens were drawn from, and on that same support.

  python -m benchmarks.truncation              # top_p 0.8, top_p 0.95, top_k 64
  python -m benchmarks.truncation --quick      # top_p 0.8 alone

The workload is `benchmarks/grpo_step.py`'s first RL step: its model and initial params,
16 of its prompts, 4 samples each of 64 new tokens at temperature 1, here with
truncation. The generator records each token's log-prob under the distribution it
drew it from (truncated and renormalised); the trainer recomputes it under the same
params, once over the full softmax ("before": what a trainer that ignores the
truncation scores) and once on the support `policy.support` gives ("after", the
default). Per setting: for r = exp(logp_trainer - logp_behaviour) over the generated
tokens, the fraction outside [0.9, 1.1], the mean and the extremes; and how many tokens
fall outside the trainer's support (none can, at equal params). The workload's params
are a random init, so its next-token distributions are near uniform: the full-softmax
ratio is then about the kept mass (top_p, or k / vocab) at every token, where a
trained model's peaked distributions spread it.

Prints one line per setting, then, as the last line, one JSON object.
"""

import json

import jax
import numpy as np
from absl import app, flags

from async_rl import batching, models, policy, train_step
from async_rl.generation import Engine, GeneratorPool, Request, SamplingParams
from benchmarks.grpo_step import (GROUP, MODEL, NEW_TOKENS, PROMPT_LEN, PROMPTS, RandomPrompts,
                                  init_params)

# --quick (top_p 0.8 alone) and --seed (params, prompts and sampling) are the flags
# benchmarks/train_step.py defines.
SETTINGS = {"top_p=0.8": (0, 0.8), "top_p=0.95": (0, 0.95), "top_k=64": (64, 1.0)}
QUICK_SETTINGS = ("top_p=0.8",)
BAND = (0.9, 1.1)


def generate(params, top_k: int, top_p: float, seed: int):
  """The workload's samples of one step, drawn with the given truncation."""
  engine = Engine(MODEL, max_concurrent_decodes=PROMPTS * GROUP, max_prefill_length=PROMPT_LEN,
                  max_target_length=PROMPT_LEN + NEW_TOKENS, steps_per_call=8)
  prompts = RandomPrompts(seed)
  sampling = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p,
                            max_new_tokens=NEW_TOKENS, seed=seed)
  with GeneratorPool(engine, params) as pool:
    futures = [pool.submit(Request(i, list(next(prompts).tokens), n=GROUP, sampling=sampling))
               for i in range(PROMPTS)]
    return [t for f in futures for t in f.result(timeout=600)]


def ratio_stats(log_ratio):
  r = np.exp(log_ratio)
  return {"outside_band": float(np.mean((r < BAND[0]) | (r > BAND[1]))),
          "mean": float(r.mean()), "min": float(r.min()), "max": float(r.max())}


def measure(params, top_k: int, top_p: float, seed: int) -> dict:
  trajs = generate(params, top_k, top_p, seed)
  batch = batching.pack_dynamic(trajs, np.zeros(len(trajs), np.float32),
                                max_tokens_per_mb=1024, num_shards=1,
                                row_buckets=batching.default_row_buckets(1024))
  mask = batch.loss_mask > 0
  behav = batch.behav_logp[mask]
  recompute = jax.jit(lambda p, b: train_step.recompute_logp(p, b, model_cfg=MODEL))
  after = np.asarray(recompute(params, batch))[mask]
  before = np.asarray(recompute(params, batch.replace(top_k=None, top_p=None)))[mask]
  return {"tokens": int(mask.sum()),
          "before": ratio_stats(before - behav), "after": ratio_stats(after - behav),
          "outside_support": _outside_support(params, batch)}


def _outside_support(params, batch) -> int:
  """Generated tokens the trainer's own truncation of its logits leaves out."""
  count = 0
  for m in range(batch.tokens.shape[0]):
    x = models.hidden(params, MODEL, batch.tokens[m], batch.positions[m], batch.segment_ids[m])
    scaled_RTV = np.asarray(models.unembed(params, MODEL, x), np.float32)[:, :-1]
    R, T, V = scaled_RTV.shape
    keep = np.asarray(jax.vmap(policy.support)(
        scaled_RTV.reshape(-1, V), batch.top_k[m][:, 1:].reshape(-1),
        batch.top_p[m][:, 1:].reshape(-1))).reshape(R, T, V)
    tokens = batch.tokens[m][:, 1:, None]
    kept = np.take_along_axis(keep, tokens, -1)[..., 0]
    count += int(np.sum(~kept & (batch.loss_mask[m][:, 1:] > 0)))
  return count


def main(argv):
  del argv
  quick, seed = flags.FLAGS.quick, flags.FLAGS.seed
  params = init_params(MODEL, seed)
  names = QUICK_SETTINGS if quick else tuple(SETTINGS)
  results = {}
  for name in names:
    results[name] = r = measure(params, *SETTINGS[name], seed)
    print(f"{name}: {r['tokens']} tokens; ratio outside [{BAND[0]}, {BAND[1]}]: full softmax "
          f"{r['before']['outside_band']:.1%} (mean {r['before']['mean']:.4f}), same "
          f"support {r['after']['outside_band']:.1%} (mean {r['after']['mean']:.6f}); "
          f"{r['outside_support']} outside the trainer's support", flush=True)
  print(json.dumps({"quick": quick, "band": BAND, "settings": results}))


if __name__ == "__main__":
  app.run(main)
