"""The checks of an experiment that its components own, run once before any compute.

`config.py` declares every field and checks what concerns the config alone. A bound
that belongs to a component (the loss's clip ranges, the advantage estimator's
levels, the pool's update modes, the task's lengths and files) is checked by that
component, where it is used; `check` runs those same checks up front and puts the
config field's name in front of the component's message (a task's checks name the
fields themselves). `config_dict.from_config_dict` calls it, so a bad value on the
command line stops a binary before anything is compiled.
"""

from async_rl import advantages, loss
from async_rl.config import ExperimentConfig
from async_rl.generation.pool import UPDATE_MODES
from async_rl.tasks.registry import check_task


def check(cfg: ExperimentConfig) -> ExperimentConfig:
  """Raises ValueError naming the field whose value a component rejects; returns `cfg`."""
  loss.from_config(cfg.ppo)
  advantages.from_config(cfg.advantage, cfg.generation.max_new_tokens)
  if cfg.generation.update_mode not in UPDATE_MODES:
    raise ValueError(f"generation.update_mode must be one of {UPDATE_MODES}, got "
                     f"{cfg.generation.update_mode!r}")
  check_task(cfg)
  return cfg
