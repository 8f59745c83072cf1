"""How a run stops on a fault it cannot survive: each error's message names what failed.

A light module (no JAX), so that a binary can catch them before anything is imported
that would start a JAX backend.
"""


class ConfigError(ValueError):
  """A setting that cannot work, found before the run starts; the message names the
  field."""


class RunError(RuntimeError):
  """A run stopped on a fault it could not survive."""


class StallError(RunError):
  """A wait passed `run.stall_timeout_s`; the message names what was awaited."""


class RolloutWorkerError(RunError):
  """A rollout worker's controller failed, or its process died too often."""


class RewardFailureError(RunError):
  """The reward function failed on too many of its recent calls; the message names it
  and its first error."""


class NoTrainableGroupError(RunError):
  """Groups keep finishing but none can be trained; the message says why they could
  not."""


class NonFiniteError(RunError):
  """Too many consecutive training steps had a non-finite loss or gradient."""


class WorkdirError(RunError):
  """The workdir could not be written (a full disk, an unwritable or vanished workdir);
  the message says where and why."""


class CheckpointError(WorkdirError):
  """A checkpoint could not be written; the message says where, why, and which
  checkpoint is the last good one."""


class VersionError(RunError, ValueError):
  """A hand-off broke the version protocol (a token newer than the published params, or
  staler than the bound, a version that did not increase); the message names the
  sample and the versions. Nothing is trained on it."""


class NoUsableCheckpointError(RunError):
  """Checkpoints exist, but none of them can be restored."""


class WorkdirInUseError(RunError):
  """Another run holds the workdir; the message names it (host, pid, start time)."""


class StopRequested(Exception):
  """The run was asked to stop (a signal) while this waited; not a fault."""


class ReplayError(RunError):
  """A replay found its record unusable, or the re-executed run different from it; the
  message names the step and what differs."""
