"""Reward functions as TRL and verl users write them, called once per completion.

The reward service calls `fn(completion, reference) -> float` for each completion, in
a worker process under its timeout, and counts what fails. `Reward` is such a
function over one or several reward functions, each called in its own style:

  single  `fn(completion, reference) -> float`, the library's own. The reference of a
          data set row (`Row`) is its `answer`.
  trl     TRL's batched form `fn(completions, **columns) -> list[float]`, called with
          one completion: `prompts=[prompt]`, `completions=[completion]` and every
          other column of the row as a one-element list (`solution=[...]`). The
          completion of a conversational prompt is `[{"role": "assistant",
          "content": text}]`, as TRL passes it. A reference that is not a row is
          passed as the column `reference`, with no `prompts`.
  verl    verl's `compute_score(data_source, solution_str, ground_truth, extra_info)`,
          returning a number or a dict with a "score", called with keywords: the row's
          `data_source` and `extra_info` columns (None where absent) and
          `reward_model["ground_truth"]`, else the row's answer. A reference that is
          not a row is the ground truth.
  auto    decided per function by its parameters: one named `solution_str` or
          `ground_truth` is verl's, one named `completions` or `prompts` TRL's, and
          anything else single.

Several functions give the sum of their rewards, each times its weight (default 1); a
TRL function's None (TRL's "does not apply to this sample") adds nothing, and a
completion to which none applies is an error. A function that returns the wrong kind
of value (a list where a number is expected, a number where TRL's list is) raises a
TypeError naming the function and the fix, so the run counts an error instead of
training on a silent 0.
"""

import dataclasses
import inspect
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

from async_rl.config import REWARD_STYLES
from async_rl.rewards.registry import resolve_reward_fn

_VERL_PARAMS = ("solution_str", "ground_truth")
_TRL_PARAMS = ("completions", "prompts")


@dataclasses.dataclass(frozen=True)
class Row:
  """A data set row as the reference of its prompt (the data task's, `tasks.data_task`),
  so that each style of reward function receives what it expects of it.

  Attributes:
    prompt: the prompt as the file holds it: a string, or a list of {"role",
      "content"} messages (TRL's conversational format).
    answer: what `fn(completion, reference)` receives as `reference`: the answer
      column's value, or the columns below when there is no answer column.
    columns: every column of the row but the prompt, as TRL passes them to a reward
      function and verl reads `data_source`, `reward_model` and `extra_info`.
  """
  prompt: Union[str, list]
  answer: Any
  columns: Mapping[str, Any]


def style_of(fn: Callable) -> str:
  """The style "auto" gives `fn`: "verl", "trl" or "single", by its parameter names."""
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):  # A builtin or an object without a signature.
    return "single"
  if any(p in params for p in _VERL_PARAMS):
    return "verl"
  if any(p in params for p in _TRL_PARAMS):
    return "trl"
  return "single"


@dataclasses.dataclass(frozen=True)
class _Term:
  name: str
  fn: Callable
  style: str
  weight: float


class Reward:
  """`reward(completion, reference) -> float`: the weighted sum of reward functions,
  each called in its style.

  Args:
    fns: a reward function or its name (a key of `REWARD_FNS` or "module:function"),
      several names separated by commas, or a sequence of either.
    style: one of `config.REWARD_STYLES`, for every function.
    weights: one per function; empty: all 1.
    field: the config field `fns` came from, for messages.

  Raises:
    ValueError: an unknown name or style, or weights that do not match the functions.
  """

  def __init__(self, fns, *, style: str = "auto", weights: Sequence[float] = (),
               field: str = "reward_fn"):
    if isinstance(fns, str):
      fns = [name.strip() for name in fns.split(",")]
    elif callable(fns):
      fns = [fns]
    fns = list(fns)
    if not fns:
      raise ValueError(f"{field} must name at least one reward function")
    if style not in REWARD_STYLES:
      raise ValueError(f"reward style must be one of {REWARD_STYLES}, got {style!r}")
    weights = tuple(weights) or (1.0,) * len(fns)
    if len(weights) != len(fns):
      raise ValueError(f"{len(weights)} reward weights for the {len(fns)} reward functions "
                       f"of {field}")
    terms = []
    for fn, weight in zip(fns, weights):
      resolved = resolve_reward_fn(fn, field)
      terms.append(_Term(_name(fn), resolved,
                         style_of(resolved) if style == "auto" else style, float(weight)))
    self.terms = tuple(terms)
    # The reward service names a function object by its __qualname__ in its log lines.
    self.__qualname__ = ",".join(t.name for t in self.terms)

  def __call__(self, completion: Any, reference: Any) -> float:
    total, applied = 0.0, False
    for term in self.terms:
      try:
        value = _CALLS[term.style](term, completion, reference)
      except Exception as e:
        if len(self.terms) == 1:
          raise
        raise RuntimeError(f"reward fn {term.name}: {type(e).__name__}: {e}") from e
      if value is not None:
        total, applied = total + term.weight * value, True
    if not applied:
      raise ValueError(f"every reward function ({self.__qualname__}) returned None (does "
                       f"not apply) for this completion")
    return total

  def __repr__(self) -> str:
    return "Reward(" + ", ".join(f"{t.name} [{t.style}] x {t.weight:g}"
                                 for t in self.terms) + ")"


def _name(fn) -> str:
  if isinstance(fn, str):
    return fn
  module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
  return f"{module}:{qualname}" if module and qualname else repr(fn)


def _number(term: _Term, value, wanted: str) -> float:
  if isinstance(value, numbers.Real):
    return float(value)
  if hasattr(value, "__len__") and not isinstance(value, (str, bytes)):
    raise TypeError(
        f"reward fn {term.name} returned a {type(value).__name__} where {wanted} is "
        f"expected: a batched TRL-style function `f(completions, **columns) -> "
        f"list[float]` needs rollout.reward_style='trl' (or 'auto', with its first "
        f"parameter named `completions`); else return one float")
  raise TypeError(f"reward fn {term.name} must return {wanted}, got "
                  f"{type(value).__name__} {value!r}")


def _single(term: _Term, completion, reference) -> float:
  answer = reference.answer if isinstance(reference, Row) else reference
  return _number(term, term.fn(completion, answer), "a number")


def _trl(term: _Term, completion, reference) -> Optional[float]:
  if isinstance(reference, Row):
    kwargs = {k: [v] for k, v in reference.columns.items()}
    kwargs["prompts"] = [reference.prompt]
    if not isinstance(reference.prompt, str):
      completion = [{"role": "assistant", "content": completion}]
  else:
    kwargs = {"reference": [reference]}
  kwargs["completions"] = [completion]
  values = term.fn(**kwargs)
  if isinstance(values, numbers.Real) or not hasattr(values, "__len__"):
    raise TypeError(
        f"reward fn {term.name} is called in TRL's batched style and must return a list "
        f"of one reward per completion, got {type(values).__name__} {values!r}; a "
        f"function `f(completion, reference) -> float` needs "
        f"rollout.reward_style='single'")
  if len(values) != 1:
    raise ValueError(f"reward fn {term.name} returned {len(values)} rewards for 1 "
                     f"completion")
  return None if values[0] is None else _number(term, values[0], "a number in its list")


def _verl(term: _Term, completion, reference) -> float:
  if isinstance(reference, Row):
    columns = reference.columns
    spec = columns.get("reward_model")
    truth = (spec["ground_truth"] if isinstance(spec, Mapping) and "ground_truth" in spec
             else reference.answer)
    source, extra = columns.get("data_source"), columns.get("extra_info")
  else:
    truth, source, extra = reference, None, None
  value = term.fn(data_source=source, solution_str=completion, ground_truth=truth,
                  extra_info=extra)
  if isinstance(value, Mapping):
    if "score" not in value:
      raise ValueError(f"reward fn {term.name} returned a dict without 'score': "
                       f"{sorted(value)}")
    value = value["score"]
  return _number(term, value, "a number (or a dict with a 'score')")


_CALLS = {"single": _single, "trl": _trl, "verl": _verl}
