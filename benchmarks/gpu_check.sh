#!/usr/bin/env bash
# A few RL steps of the 1.5B-shaped model (random weights, arithmetic task) on the
# host's accelerators, then its throughput. Meant to finish within 8 minutes on one GPU.
# With several devices the run splits them (`config.placement`): the trainer on the first
# half, one generator replica on each of the others; the JSON line then gives each
# replica's generated tokens per second and the trainer's tokens per second per device.
#
#   benchmarks/gpu_check.sh [extra launch.train flags]
#
# Environment: GPU_CHECK_CONFIG (default configs/qwen2_5_1_5b.py) and GPU_CHECK_STEPS
# (default 5). Extra flags come after the defaults below, so they win; for example
#
#   GPU_CHECK_CONFIG=configs/micro.py GPU_CHECK_STEPS=2 benchmarks/gpu_check.sh
#
# runs in seconds on a CPU. The run goes to a temporary workdir, removed at the end.
# Prints the step lines, then one JSON line over the steps after the first (which
# compiles): the median trainer step time (waiting for a batch + packing + update +
# publishing), trained tokens per second of update time, generated tokens per second
# of those steps' time (all generators), and the wall time of the whole run.
set -euo pipefail
cd "$(dirname "$0")/.."

config="${GPU_CHECK_CONFIG:-configs/qwen2_5_1_5b.py}"
steps="${GPU_CHECK_STEPS:-5}"
workdir="$(mktemp -d)"
trap 'rm -rf "${workdir}"' EXIT

devices=$(python -c "import jax; print(jax.local_device_count())")
split=()
if (( devices > 1 )); then
  split=(--config.placement.trainer_devices=$(( devices / 2 )) --config.mesh.fsdp=-1)
fi

start=$(date +%s)
# Evaluation (before and after RL) is cut to 16 greedy completions: it is not timed.
python -m launch.train --config="${config}" --workdir="${workdir}" \
  --config.num_steps="${steps}" --config.eval.num_prompts=16 --config.eval.pass_k=1 \
  "${split[@]}" "$@"
wall=$(( $(date +%s) - start ))

python - "${workdir}/metrics.jsonl" "${config}" "${wall}" <<'PY'
import json
import statistics
import sys

import jax

path, config, wall = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open(path) as f:
  steps = [m for m in map(json.loads, f) if "eval" not in m and "sft" not in m]
timed = steps[1:] or steps
step_s = [m["time_wait_s"] + m["time_pack_s"] + m["time_train_s"] + m["time_publish_s"]
          for m in timed]
generated = timed[-1]["rollout"]["generated_tokens"] - (
    steps[0]["rollout"]["generated_tokens"] if len(steps) > 1 else 0)
pools = [m["workers"]["0"]["pool"] for m in steps]  # one rollout worker in process
first, last = (pools[0] if len(steps) > 1 else {}), pools[-1]
replicas = last.get("replicas", [last])
before = first.get("replicas", [first] if first else [])
per_replica = [(r["generated_tokens"] - (before[i]["generated_tokens"] if before else 0))
               / sum(step_s) for i, r in enumerate(replicas)]
trainer_devices = jax.local_device_count() // 2 if jax.local_device_count() > 1 else 1
train_tokens_per_s = (sum(m["trained_tokens"] for m in timed)
                      / sum(m["time_train_s"] for m in timed))
print(json.dumps({
    "config": config, "device": jax.devices()[0].device_kind, "steps": len(steps),
    "devices": jax.local_device_count(), "trainer_devices": trainer_devices,
    "generator_replicas": len(replicas),
    "gen_tokens_per_s_per_replica": [round(x, 1) for x in per_replica],
    "train_tokens_per_s_per_device": round(train_tokens_per_s / trainer_devices, 1),
    "step_time_s": round(statistics.median(step_s), 3),
    "train_tokens_per_s": round(train_tokens_per_s, 1),
    "gen_tokens_per_s": round(generated / sum(step_s), 1),
    "trained_tokens_per_step": round(statistics.mean(m["trained_tokens"] for m in timed)),
    "wall_s": wall}))
PY
