r"""The GRPO workload (`benchmarks/grpo_step.py`) through Google Tunix's `GRPOLearner`, on CPU.

  python -m venv /tmp/tunix_venv
  /tmp/tunix_venv/bin/pip install google-tunix==0.1.7   # pulls jax/jaxlib 0.10.2 (CPU)
  /tmp/tunix_venv/bin/python benchmarks/peers/tunix_grpo.py [--steps 10] [--seed 0]

A peer baseline, for a side-by-side comparison with the library's synchronous run,
`python -m benchmarks.grpo_step --variants=sync_naive`, whose docstring fixes the
workload, and with `benchmarks/peers/trl_grpo.py`; it runs in its own virtualenv
(Tunix and its own JAX, not the project's). The same workload: Tunix's Qwen2
(`tunix.models.qwen2`: vocab 256, hidden 128, 4 layers, 4 query / 2 KV heads, head_dim
32, MLP 512, q/k/v bias, tied embeddings, float32, RoPE theta 1e6, RMSNorm eps 1e-6)
with weight matrices ~ N(0, 0.02), biases 0 and norm scales 1 (set here after building:
Tunix inits the embedding N(0, 1), attention glorot-uniform and the MLP zeros; checked);
per RL step 16 prompts of 16 ids uniform in [3, 255] (the same prompts as the library's
stream for the seed), 4 samples each at temperature 1, no top-k / top-p (Tunix's
vanilla sampler then draws `categorical` on the full logits), exactly 64 new tokens
(eos and pad are id 256, outside what the model can emit; checked on every
completion); reward the fraction of even completion ids; group-normalised advantages
(Tunix's `grpo` estimator: the group's sample std, ddof 1, + 1e-6, as the library's),
eps 0.2, AdamW at 1e-4 (constant, no weight decay, global-norm clip 1, optax's
defaults otherwise, as the library's), beta 0 (no KL term, no reference model: Tunix
builds none), num_iterations 1 and one optimizer step per RL step: the 64 samples
generate in one batch (rollout micro-batch 16 prompts x 4) and make one train batch
(mini- and micro-batch 16 prompts), so with num_iterations 1 Tunix takes the old
log-probs as the stop-gradient of the train forward's own (ratio 1, naive PPO, as
sync_naive) and runs no extra forward. float32, no remat, no checkpoints, no metrics
backend (metrics stay in memory). The learner's rollout and trainer share the model
(one mesh, (fsdp, tp) = (1, 1)), so there is no weight sync.

Beyond the workload, and not to be turned off: the loss forward also takes the
per-token entropy and a dozen logged diagnostics; the sampler prefills each of the
64 sequences (the library prefills a prompt once for its group) and, as the model has
no `decode_only_last_token`, projects all 16 prompt positions to logits; each decode
step attends over the whole 80-slot KV cache (masked); the train forward also masks
attention by a per-token segment id (all one here); the learner tokenizes text prompts
and detokenizes completions (the reward parses the text back to ids). Tunix's vanilla
rollout reuses one sampling seed for every call (`RolloutConfig.seed`, default key 0);
this script sets a fresh seed (from --seed and the step) before each generation.

Measures the wall time of an RL step, from the end of one optimizer update to the end
of the next (the end of `RLCluster.update_actor`, wrapped here, after blocking on the
updated params: Tunix dispatches the step asynchronously), median and min over the
steps after the first WARMUP, the generation / training split (the wrapped
`RLCluster.generate` and `update_actor` calls; the rest is tokenizing, the reward and
advantages, and queueing between Tunix's data thread and its train loop), and the
float32 1024^3 matmul rate with jax before and after training. Prints a summary, then,
as the last line, one JSON object (`gen_s` and `train_s` are the medians of the two
parts over the timed steps).
"""

import argparse
import collections
import json
import logging
import os
import time
import warnings

import jax
import jax.numpy as jnp
import flax
import numpy as np
import optax
import tunix
from flax import nnx
from tunix.models.qwen2 import model as qwen2
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

from peer_workload import (GROUP, INIT_STD, NEW_TOKENS, PROMPT_LEN, PROMPTS, VOCAB, WARMUP,
                           even_fraction, make_tokenizer, prompt_ids)


def make_model(seed: int) -> qwen2.Qwen2:
  """The workload's model in Tunix's Qwen2, its params re-drawn by the workload's rules."""
  config = qwen2.ModelConfig(
      num_layers=4, vocab_size=VOCAB, embed_dim=128, hidden_dim=512, num_heads=4, head_dim=32,
      num_kv_heads=2, rope_theta=1_000_000, norm_eps=1e-6, use_tied_embedding=True,
      dtype=jnp.float32, param_dtype=jnp.float32)
  model = qwen2.Qwen2(config, rngs=nnx.Rngs(seed))
  state = nnx.state(model, nnx.Param)
  flat = nnx.to_flat_state(state)
  key = jax.random.key(seed)
  new = []
  for i, (path, var) in enumerate(flat):
    name = "/".join(map(str, path))
    x = var.get_value() if hasattr(var, "get_value") else var.value
    if path[-1].endswith("bias"):
      x = jnp.zeros_like(x)
    elif "norm" in name:
      x = jnp.ones_like(x)
    else:  # Embedding (tied head), q/k/v/o einsum weights, MLP kernels.
      x = INIT_STD * jax.random.normal(jax.random.fold_in(key, i), x.shape, jnp.float32)
    new.append((path, x))
  nnx.update(model, nnx.from_flat_state([(p, var.replace(x)) for (p, var), (_, x)
                                         in zip(flat, new)]))
  names = []
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    name, x = "/".join(map(str, path)), np.asarray(var.get_value())
    names.append(name)
    assert x.dtype == np.float32, name
    if path[-1].endswith("bias"):
      assert not x.any(), name
    elif "norm" in name:
      assert (x == 1).all(), name
    else:
      assert abs(x.std() - INIT_STD) < 2e-3 and abs(x.mean()) < 2e-3, name
  assert not any("lm_head" in n for n in names)  # Tied: the head is the embedding.
  assert sum("bias" in n for n in names) == 3 * 4
  return model


def matmul_peak(size=1024, reps=10) -> float:
  """Best float32 FLOP/s of a jitted [size, size] @ [size, size] over `reps` calls."""
  a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
  f = jax.jit(jnp.matmul)
  jax.block_until_ready(f(a, a))  # Compiles and warms up.
  best = float("inf")
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(f(a, a))
    best = min(best, time.perf_counter() - start)
  return 2 * size**3 / best


class EvenFraction:
  """The reward (the share of even completion ids), keeping the step means."""
  __name__ = "even_fraction"

  def __init__(self):
    self.means = []

  def __call__(self, prompts, completions, **kwargs):
    rewards = [even_fraction(text.split()) for text in completions]
    self.means.append(float(np.mean(rewards)))
    return rewards


class Clock:
  """Wraps the cluster's `generate` and `update_actor`: their spans and lengths.

  `generate` runs on Tunix's data thread, `update_actor` (one optimizer step here) on
  the main one; an update's end is taken after its params are ready.
  """

  def __init__(self, cluster: rl_cluster_lib.RLCluster, seed: int):
    self.ends, self.gen_s, self.train_s = [], [], []
    self.lengths = collections.Counter()
    generate, update = cluster.generate, cluster.update_actor
    rollout_config = cluster.get_rollout_config(rl_cluster_lib.Mode.TRAIN)

    def timed_generate(*args, **kwargs):
      rollout_config.seed = jax.random.fold_in(jax.random.key(seed), len(self.gen_s))
      start = time.perf_counter()
      out = generate(*args, **kwargs)
      self.gen_s.append(time.perf_counter() - start)
      self.lengths.update(len(t) for t in out.tokens)
      assert all(0 <= int(i) < VOCAB for t in out.tokens for i in t)
      return out

    def timed_update(*args, **kwargs):
      start = time.perf_counter()
      out = update(*args, **kwargs)
      jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
      self.ends.append(time.perf_counter())
      self.train_s.append(self.ends[-1] - start)
      return out

    cluster.generate, cluster.update_actor = timed_generate, timed_update


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=10, help="RL steps, the first 2 untimed.")
  parser.add_argument("--seed", type=int, default=0, help="Seed of params, prompts, sampling.")
  flags = parser.parse_args()
  if flags.steps <= WARMUP:
    parser.error(f"--steps must exceed the {WARMUP} warm-up steps")
  assert jax.default_backend() == "cpu", jax.default_backend()
  logging.getLogger("absl").setLevel(logging.WARNING)
  warnings.filterwarnings("ignore", category=DeprecationWarning)  # Sampler's _init_cache.

  tokenizer = make_tokenizer()
  ids = prompt_ids(flags.seed, PROMPTS * flags.steps)
  prompts = [" ".join(map(str, p)) for p in ids]
  assert [tokenizer.encode(p) for p in prompts] == ids
  train_ds = [{"prompts": np.array(prompts[s * PROMPTS:(s + 1) * PROMPTS])}
              for s in range(flags.steps)]

  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rollout_config = base_rollout.RolloutConfig(
      max_tokens_to_generate=NEW_TOKENS, max_prompt_length=PROMPT_LEN,
      kv_cache_size=PROMPT_LEN + NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=None,
      eos_tokens=[VOCAB], data_type=jnp.float32)
  cluster_config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                    rl_cluster_lib.Role.ROLLOUT: mesh},
      rollout_engine="vanilla", offload_to_cpu=False,
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=optax.chain(optax.clip_by_global_norm(1.0),
                                      optax.adamw(1e-4, weight_decay=0.0)),
          eval_every_n_steps=10**9, max_steps=flags.steps, mini_batch_size=PROMPTS,
          train_micro_batch_size=PROMPTS, rollout_micro_batch_size=PROMPTS,
          compute_logps_micro_batch_size=PROMPTS, checkpoint_root_directory=None,
          metrics_logging_options=None, pbar_description=None),
      rollout_config=rollout_config)
  with mesh:
    model = make_model(flags.seed)
  cluster = rl_cluster_lib.RLCluster(actor=model, reference=None, tokenizer=tokenizer,
                                     cluster_config=cluster_config)
  assert cluster.rollout.eos_id() == cluster.rollout.pad_id() == VOCAB
  reward = EvenFraction()
  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster,
      algo_config=grpo_learner.GRPOConfig(
          num_generations=GROUP, num_iterations=1, beta=0.0, epsilon=0.2),
      reward_fns=reward)
  assert not learner.should_sync_weights  # Rollout and trainer share the params.
  clock = Clock(cluster, flags.seed)

  peaks = [matmul_peak()]
  learner.train(train_ds)
  peaks.append(matmul_peak())

  assert len(clock.ends) == flags.steps == cluster.actor_trainer.train_steps, (
      len(clock.ends), cluster.actor_trainer.train_steps)
  assert clock.lengths == {NEW_TOKENS: PROMPTS * GROUP * flags.steps}, clock.lengths
  step_s = np.diff(clock.ends)[WARMUP - 1:]
  gen_s, train_s = np.array(clock.gen_s[WARMUP:]), np.array(clock.train_s[WARMUP:])
  peak = max(peaks)
  print(f"tunix {tunix.__version__}, jax {jax.__version__}, flax {flax.__version__}"
        f", optax {optax.__version__}, {os.cpu_count()} CPUs; {flags.steps} steps, the first "
        f"{WARMUP} untimed\nstep: median {np.median(step_s):.3f} s, min {step_s.min():.3f} s "
        f"over {len(step_s)} steps; generate median {np.median(gen_s):.3f} s, update median "
        f"{np.median(train_s):.3f} s; float32 1024^3 matmul best {peak / 1e9:.1f} GFLOP/s of "
        f"{', '.join(f'{p / 1e9:.0f}' for p in peaks)} (before and after)\ncompletion lengths "
        f"{dict(clock.lengths)}; mean reward per step {np.round(reward.means, 3).tolist()}")
  print(json.dumps({
      "system": "tunix", "tunix_version": tunix.__version__, "jax_version": jax.__version__,
      "flax_version": flax.__version__, "optax_version": optax.__version__,
      "cpus": os.cpu_count(), "steps": flags.steps, "warmup": WARMUP,
      "timed_steps": len(step_s), "sec_per_step": round(float(np.median(step_s)), 4),
      "min_step_s": round(float(step_s.min()), 4),
      "step_s": [round(float(s), 4) for s in step_s],
      "gen_s": round(float(np.median(gen_s)), 4), "train_s": round(float(np.median(train_s)), 4),
      "matmul_gflops": round(peak / 1e9, 2),
      "matmul_gflops_runs": [round(p / 1e9, 2) for p in peaks],
      "completion_lengths": {str(n): c for n, c in sorted(clock.lengths.items())},
      "reward_mean": [round(min(reward.means), 4), round(max(reward.means), 4)]}))


if __name__ == "__main__":
  main()
