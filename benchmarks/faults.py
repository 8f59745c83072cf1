r"""Fault injection: the micro config through a schedule of faults, and what survived.

  python -m benchmarks.faults            # the seven faults below
  python -m benchmarks.faults --quick    # the five that run in this process (1-5)

Deadlines are seconds here (`run.warn_after_s=2`, `run.stall_timeout_s` from
--stall_timeout_s, 45 by default, `rollout.reward_timeout_s=1`), not the minutes of a
real run, and the stalled generator (fault 4) is reported after the stall timeout. The
deadlines count compiling: an in-process run compiles its engine's calls before it
starts (`Engine.warmup`), so that its deadlines time the run however long compiling
takes on a loaded CPU, and the stall timeout of the subprocess runs leaves room for
their first compilations. The faults:

  in this process, one run of --steps steps, then its resume:
  1. non_finite_step       the batch of step 2 carries NaN behaviour log-probs;
                           survived: step 2 is skipped, counted, and training goes on.
  2. raising_reward        the reward function raises on about 1 completion in 4
                           (`common.fault_rewards.flaky`); survived: those
                           score 0, are counted, and training goes on.
  3. hanging_reward        it never returns on about 1 in 11; survived: each is killed
                           after rollout.reward_timeout_s, scores 0, is counted.
  4. stalled_generator     from version 3 the rollout pool's decode step never
                           returns; survived: the run stops within the stall timeout
                           with an error naming the generator, having checkpointed,
                           and its resume reaches --steps.
  5. truncated_checkpoint  before that resume, the newest checkpoint's largest file
                           is cut in half; survived: the resume reports it and
                           continues from the checkpoint before.
  with Ray (a local instance):
  6. worker_kill           the rollout worker's process is SIGKILLed while scoring a
                           group; survived: a new worker takes over and the run reaches
                           --steps, its lost groups written off and issued again.
  in a `launch.train` subprocess:
  7. trainer_kill          SIGKILL after checkpoint 2, then the same command again;
                           survived: the resume reaches --steps.

Across every run: `lost_samples` are the samples of prompts drawn and neither trained
(once), nor rejected, nor queued to be issued again, by each run's last checkpoint;
`staleness_violations` the trained tokens staler than η; `longest_unreported_wait_s`
the longest any wait went without a log line. Last line: one JSON object.
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from async_rl.cli import from_dict
from async_rl.config import ExperimentConfig
from async_rl.launch import parse_flags
from async_rl.param_server import ParameterServer
from async_rl.rl import build, entry
from async_rl.rl.audit import prompt_accounting, step_lines
from async_rl.rl.errors import StallError
from async_rl.tasks.registry import make_task
from async_rl.trajectory import Group
from benchmarks.common import fault_rewards

_CONFIG = config_flags.DEFINE_config_file("config", "configs/micro.py", "The experiment.")
_QUICK = flags.DEFINE_bool("quick", False, "Only the faults that run in this process (1-5).")
_STEPS = flags.DEFINE_integer("steps", 6, "Training steps of each run (at least 6: with "
                              "η = 1 the stall at version 3 must leave groups to generate).")
_OUT_DIR = flags.DEFINE_string("out_dir", "/tmp/async_rl_faults", "Workdirs go here.")
_STALL_TIMEOUT_S = flags.DEFINE_float("stall_timeout_s", 45.0, "run.stall_timeout_s of every run.")

ROOT = Path(__file__).parents[1]
# Named for the reward workers, which import them.
FLAKY = f"{fault_rewards.__name__}:{fault_rewards.flaky.__name__}"
KILLER = f"{fault_rewards.__name__}:{fault_rewards.kills_its_rollout_worker.__name__}"
POISONED_STEP, STALL_AT = 2, 3


def fault_config(cfg: ExperimentConfig, steps: int, reward_fn: str) -> ExperimentConfig:
  return dataclasses.replace(
      cfg, num_steps=steps, checkpoint=dataclasses.replace(cfg.checkpoint, every_steps=1,
                                                           keep=steps + 1),
      run=dataclasses.replace(cfg.run, warn_after_s=2.0, stall_timeout_s=_STALL_TIMEOUT_S.value),
      rollout=dataclasses.replace(cfg.rollout, reward_fn=reward_fn, reward_timeout_s=1.0))


class _Poisoning:
  """The server, except that the batch trained into version `step` has NaN log-probs."""

  def __init__(self, server, step):
    self._server, self._step = server, step

  def __getattr__(self, name):
    return getattr(self._server, name)

  def get_batch(self, timeout=None):
    groups = self._server.get_batch(timeout)
    if groups is None or self._server.version() != self._step - 1:
      return groups
    return [Group(g.prompt_id, tuple(
        dataclasses.replace(t, logp_T=np.where(t.loss_mask_T, np.nan, t.logp_T))
        for t in g.trajectories)) for g in groups]


def _run_here(cfg, workdir, *, poison=None, stall_at=None):
  """One in-process run, its rollout and held-out pools on one engine as `entry.run`
  builds them, with every call of the engine compiled before it starts; with
  `stall_at`, the decode step hangs from then."""
  server = ParameterServer(cfg.staleness, cfg.batch_groups)
  lines = []
  cfg = build.resolve(cfg)
  task = make_task(cfg.task)
  engines = [build.make_engine(cfg)]
  loop = build.train_loop(cfg, workdir, server if poison is None else _Poisoning(server, poison),
                          task=task, engines=engines, echo=lines.append, progress=False)
  worker = build.rollout_worker(cfg, server, task=task, engines=engines)
  release = threading.Event()

  def stall():
    while server.version() < stall_at and not release.is_set():
      time.sleep(0.05)
    worker.pool.engine.generate_chunk = lambda *args, **kwargs: release.wait()

  try:
    engines[0].warmup(server.fetch(-1)[1])
    if stall_at is not None:
      threading.Thread(target=stall, daemon=True).start()
    return loop.run([worker]), lines, None
  except StallError as e:
    return None, lines, e
  finally:
    release.set()
    server.close()
    worker.close()
    loop.close()


def in_process_faults(cfg, workdir):
  """Faults 1-5: one run with a poisoned batch, flaky rewards and a stalled generator,
  then its resume past a truncated checkpoint."""
  _, first_lines, stall = _run_here(cfg, workdir, poison=POISONED_STEP, stall_at=STALL_AT)
  newest = max(int(p.name) for p in (Path(workdir) / "checkpoints").iterdir()
               if p.name.isdigit())
  data = max((p for p in (Path(workdir) / "checkpoints" / str(newest)).rglob("*")
              if p.is_file()), key=lambda p: p.stat().st_size)
  with open(data, "r+b") as f:
    f.truncate(data.stat().st_size // 2)
  summary, lines, again = _run_here(cfg, workdir)
  steps = {s["step"]: s for s in step_lines(workdir)}
  last = steps.get(cfg.num_steps, {})
  finished = summary is not None and summary["end_version"] == cfg.num_steps
  # Which completions raise or hang depends on what was sampled, and with async
  # batches that depends on timing: count them over both runs (every logged line,
  # the first run's included), not over the resume alone.
  logged = [json.loads(line) for line in
            (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
  counted = lambda key: any(line.get("rewards", {}).get(key, 0) > 0 for line in logged)
  return {
      "non_finite_step": finished and steps[POISONED_STEP]["skipped"] == 1
                         and last["skipped_steps"] == 1,
      "raising_reward": finished and counted("errors"),
      "hanging_reward": finished and counted("timeouts"),
      "stalled_generator": (stall is not None and "rollout worker 0 generator" in str(stall)
                            and "holds the params" in str(stall) and finished),
      "truncated_checkpoint": finished and summary["damaged_checkpoints"] == 1
                              and any(f"checkpoint {newest} is damaged" in l for l in lines),
  }, [workdir], {"stall": str(stall) if stall else None, "resume_error": repr(again),
                 "warnings": [l for l in first_lines + lines if l.startswith("WARNING")]}


def worker_kill(cfg, workdir):
  """Fault 6: under Ray, the rollout worker's process dies while scoring a group."""
  os.environ["FAULTS_KILL_COUNT"] = os.path.join(workdir, "reward_calls")
  os.environ["FAULTS_KILL_AT"] = str(3 * cfg.batch_groups * cfg.generation.group_size + 1)
  os.makedirs(workdir, exist_ok=True)
  summary = entry.run(dataclasses.replace(
      cfg, rollout=dataclasses.replace(cfg.rollout, reward_fn=KILLER),
      placement=dataclasses.replace(cfg.placement, kind="ray")), workdir,
      progress=False, echo=lambda _: None)
  last = step_lines(workdir)[-1]
  survived = (summary["end_version"] == cfg.num_steps and last["worker_restarts"] == 1
              and last["server"]["lost_groups"] >= 1)
  return {"worker_kill": survived}, [workdir], {"lost_groups": last["server"]["lost_groups"]}


def _train(workdir, steps):
  cmd = [sys.executable, "-m", "launch.train", "--config=configs/micro.py",
         f"--workdir={workdir}", f"--config.num_steps={steps}",
         f"--config.rollout.reward_fn={FLAKY}", "--config.rollout.reward_timeout_s=1",
         "--config.run.warn_after_s=2", f"--config.run.stall_timeout_s={_STALL_TIMEOUT_S.value}"]
  return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def trainer_kill(cfg, workdir):
  """Fault 7: `launch.train` SIGKILLed after checkpoint 2, then run again."""
  proc = _train(workdir, cfg.num_steps)
  checkpoints = Path(workdir) / "checkpoints"
  while proc.poll() is None and not (
      checkpoints.exists() and any(p.name.isdigit() and int(p.name) >= 2
                                   for p in checkpoints.iterdir())):
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.communicate()
  proc = _train(workdir, cfg.num_steps)
  out, _ = proc.communicate()
  survived = proc.returncode == 0 and step_lines(workdir)[-1]["step"] == cfg.num_steps
  return {"trainer_kill": survived}, [workdir], {"resume_tail": out[-500:] if not survived
                                                 else ""}


def totals(cfg, workdirs) -> dict:
  """lost_samples, staleness_violations and longest_unreported_wait_s over `workdirs`."""
  eta = cfg.staleness.max_staleness
  lost = violations = 0
  longest = 0.0
  for workdir in workdirs:
    lost += prompt_accounting(workdir)["unaccounted"] * cfg.generation.group_size
    for line in step_lines(workdir):
      violations += sum(n for k, n in line["staleness_hist"].items()
                        if eta is not None and int(k) > eta)
      longest = max(longest, line["longest_unreported_wait_s"])
  return {"lost_samples": lost, "staleness_violations": violations,
          "longest_unreported_wait_s": round(longest, 2)}


def main(argv):
  del argv
  logging.set_verbosity(logging.ERROR)  # the injected faults log loudly, as they should
  started = time.perf_counter()
  cfg = from_dict(_CONFIG.value)
  eta = cfg.staleness.max_staleness
  if eta is None or _STEPS.value < STALL_AT + eta + 2:
    raise app.UsageError(f"--steps must be at least {STALL_AT} + η + 2 (and η bounded), so "
                         f"that the generator stalled at version {STALL_AT} is needed")
  shutil.rmtree(_OUT_DIR.value, ignore_errors=True)
  cfg = fault_config(cfg, _STEPS.value, FLAKY)
  schedule = [("in_process", in_process_faults)]
  if not _QUICK.value:
    schedule += [("ray", worker_kill), ("subprocess", trainer_kill)]
  faults, workdirs = {}, []
  for name, inject in schedule:
    t0 = time.perf_counter()
    outcome, dirs, detail = inject(cfg, os.path.join(_OUT_DIR.value, name))
    faults.update(outcome)
    workdirs += dirs
    print(f"{name} ({time.perf_counter() - t0:.0f} s): "
          + ", ".join(f"{k} {'survived' if v else 'NOT SURVIVED'}" for k, v in outcome.items()),
          flush=True)
    if not all(outcome.values()):
      print(json.dumps(detail, indent=1))
  print(json.dumps({"injected": len(faults), "survived": sum(faults.values()),
                    **totals(cfg, workdirs),
                    "faults": faults, "wall_s": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
