"""The quick start's model and batch on a heavier-tailed task.

  python -m benchmarks.sync_vs_async --config=configs/tiny_long_tail.py

Problems of up to 24 operands instead of 8: solutions of up to 187 tokens (mean about
29, median 15), so the longest sample of a synchronous batch is many times the
typical one, the tail that stalls synchronous RL. Run from the repository root (it
builds on `configs/tiny.py`). On a 2-core CPU, async (η = 4, retract) trained 1.34x
the samples/s of sync here, against 1.09x on `configs/tiny.py` (BENCHMARKS.md). The
ratio depends on the slot count: 1.03-1.15x at 16 slots, where both modes run
fastest on a CPU, and up to 1.98x at 128, where sync is slowest. Re-measured at 16
slots after the train-step work: 1.61-1.80x the samples/s, but 1.04-1.09x per trained
token (that sync run wrote longer completions); the async trainer is still the
bottleneck (BENCHMARKS.md).

  python -m benchmarks.admission --config.batch_groups=16 --steps=10

measures what dropping stale groups does to these long samples, against
`staleness.on_stale=mask_tokens` (BENCHMARKS.md, "Length-fair admission").
"""

from configs import tiny


def get_config():
  c = tiny.get_config()
  c.task.max_terms = 24
  c.model.max_seq_len = 256
  c.generation.max_prompt_len = 56
  c.generation.max_new_tokens = 192
  c.generation.num_slots = 64  # As measured; the slot count decides the ratio.
  return c
