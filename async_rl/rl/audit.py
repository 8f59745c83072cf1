"""What a run's workdir says happened: its step lines, and what became of every prompt
its stream gave out."""

import json
from pathlib import Path

from async_rl.rl import checkpoint, metrics_log


def step_lines(workdir: str) -> list[dict]:
  """The step lines of `workdir/metrics.jsonl`, one per step (a resumed run removes
  the lines its checkpoint superseded), not the evaluations' or the warm start's."""
  path = Path(workdir) / metrics_log.FILE
  if not path.exists():
    return []
  lines = [json.loads(line) for line in path.read_text().splitlines()]
  return [line for line in lines if "eval" not in line and "sft" not in line]


def prompt_accounting(workdir: str, worker: int = 0) -> dict:
  """What became of every prompt rollout worker `worker` drew, by the newest checkpoint.

  Each prompt below the stream's cursor should be trained once into the checkpoint's
  params, rejected (filtered, failed or dropped as stale), or queued to be issued
  again (lost with a worker or a process, or in flight); `unaccounted` counts the
  others (skipped, or issued twice), `trained_twice` the prompts trained more than
  once. Stream positions must be `{"index": i, ...}` (the arithmetic task).
  """
  directory = str(Path(workdir) / "checkpoints")
  meta = checkpoint.read_meta(directory, checkpoint.steps(directory)[-1])
  server = meta.server
  trained = [p for line in step_lines(workdir) if line["step"] <= meta.version
             for p in line["prompts"]]
  drawn = server["ledger"]["cursor"][str(worker)]["index"]
  to_replay = len(server["ledger"]["replay"].get(str(worker), []))
  rejected = server["gate"]["rejected"]
  return {"version": meta.version, "server": server, "drawn": drawn,
          "trained": len(trained), "trained_twice": len(trained) - len(set(trained)),
          "rejected": rejected, "to_replay": to_replay,
          "unaccounted": drawn - len(set(trained)) - rejected - to_replay}
