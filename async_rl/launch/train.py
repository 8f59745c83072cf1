r"""Asynchronous RL training binary.

  async-rl-train --config=tiny --workdir=/tmp/async_rl_tiny \
      [--config.staleness.max_staleness=0] [--config.placement.kind=ray]

(in a clone of the repository, also `python -m launch.train --config=configs/tiny.py ...`).

Across hosts (`jax.distributed`): the same command on every host, with
--coordinator_address=HOST:PORT --num_processes=N --process_id=I; process 0 runs the
parameter server, the rollouts and the evaluation, every process trains.

With --replay=OLD, the run recorded in the workdir OLD is trained again in --workdir
from its recorded batches, and checked bit for bit against OLD's checkpoints
(`async_rl.rl.replay`); the config must be OLD's.

Starting again with the same --workdir resumes from its latest checkpoint. A workdir
holds one run: a second run on it exits at once with status 1, naming the first.
SIGTERM (or Ctrl-C) checkpoints the current version and exits with status 128 + the
signal's number (143, 130), so that a job controller starts the job again; a second
signal exits at once. A fault the run cannot survive (a stall past
run.stall_timeout_s, a failed rollout worker, too many non-finite steps, no
checkpoint that can be restored) exits with status 1 and a message naming it.
"""

import signal
import sys
import threading

from absl import app, flags, logging
from ml_collections import config_flags

from async_rl import cli, launch
from async_rl.rl.errors import ConfigError, RunError, WorkdirInUseError
from async_rl.rl.signals import StopOnSignals

_CONFIG = config_flags.DEFINE_config_file("config", None, launch.CONFIG_HELP, lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and logs go here.")
_REPLAY = flags.DEFINE_string("replay", None, "Replay the run recorded in this workdir "
                              "into --workdir, checking it bit for bit.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "Multi-host trainer: jax.distributed coordinator "
                                   "host:port (with --num_processes, --process_id).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "jax.distributed processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's jax.distributed id.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  signals = StopOnSignals(threading.Event())
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax is chatty at INFO; -v 0 shows it
  try:
    cfg = cli.from_dict(_CONFIG.value)
  except ValueError as e:
    raise app.UsageError(f"invalid config: {e}") from None
  if _COORDINATOR.value:
    import jax  # noqa: PLC0415 (only multi-host runs pay for the import here)
    # CPU devices of different processes talk through gloo (accelerators use their own).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(_COORDINATOR.value, num_processes=_NUM_PROCESSES.value,
                               process_id=_PROCESS_ID.value)
  from async_rl.rl import entry  # noqa: PLC0415 (after jax.distributed, which must come first)
  try:
    if _REPLAY.value:
      summary = entry.replay(cfg, _WORKDIR.value, _REPLAY.value, stop=signals.stop)
    else:
      summary = entry.run(cfg, _WORKDIR.value, stop=signals.stop)
  except ConfigError as e:
    raise app.UsageError(f"invalid config: {e}") from None
  except WorkdirInUseError as e:
    sys.exit(f"train: {e}")
  except RunError as e:
    sys.exit(f"train: the run stopped: {e}")
  logging.info("done: %s", summary)
  if signals.received is not None:  # the run has said what it saved
    print(f"train: stopped by {signal.Signals(signals.received).name}; exit status "
          f"{signals.exit_status}", file=sys.stderr)
    sys.exit(signals.exit_status)


def run():
  """The console script `async-rl-train`."""
  launch.run(main, __name__)


if __name__ == "__main__":
  run()
