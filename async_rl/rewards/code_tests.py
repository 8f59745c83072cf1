"""Rewards for code-reasoning tasks: run the completion's program on test cases.

A test case is `{"input": stdin, "output": expected stdout}`; the reference is a
list of them, or that list as a JSON string. Outputs are compared line by line,
ignoring trailing whitespace and blank lines at either end. Each run goes through
`run_sandboxed`, so the service's `timeout_s` must exceed the number of cases times
`CASE_TIMEOUT_S` (plus start-up, and about a second once per worker process while
the sandbox probes the machine), or the whole call times out and scores 0.

Where the full sandbox cannot run (`sandbox.isolation().missing` says why) these
rewards refuse to run the program: they raise, so the call scores 0 and is counted
as an error, with a message naming what is missing. They run it in the weak sandbox
only when the environment variable `ASYNC_RL_ALLOW_WEAK_SANDBOX` is "1", which
`RewardService(allow_weak_sandbox=True)` sets in its workers from the config's
`rollout.allow_weak_sandbox`; the sandbox then warns once per process.
"""

import json
import os
import re
from collections.abc import Mapping, Sequence

from async_rl.rewards.sandbox import run_sandboxed

CASE_TIMEOUT_S = 2.0
CASE_MEMORY_MB = 512
ALLOW_WEAK_SANDBOX_ENV = "ASYNC_RL_ALLOW_WEAK_SANDBOX"
_FENCED = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
  """The last fenced code block of `completion`, or all of it when it has none."""
  blocks = _FENCED.findall(completion)
  return blocks[-1] if blocks else completion


def _cases(tests: str | Sequence[Mapping[str, str]]) -> list[tuple[str, str]]:
  if isinstance(tests, str):
    tests = json.loads(tests)
  if not isinstance(tests, Sequence) or not tests:
    raise ValueError(f"tests must be a non-empty list of cases, got {tests!r:.200}")
  cases = []
  for i, case in enumerate(tests):
    if not (isinstance(case, Mapping) and isinstance(case.get("input"), str)
            and isinstance(case.get("output"), str)):
      raise ValueError(f"test case {i} must map 'input' and 'output' to strings, "
                       f"got {case!r:.200}")
    cases.append((case["input"], case["output"]))
  return cases


def _lines(text: str) -> list[str]:
  return [line.rstrip() for line in text.strip().splitlines()]


def _passes(code: str, stdin: str, expected: str) -> bool:
  result = run_sandboxed(code, stdin, timeout_s=CASE_TIMEOUT_S, memory_mb=CASE_MEMORY_MB,
                         allow_weak=os.environ.get(ALLOW_WEAK_SANDBOX_ENV) == "1")
  return (result.returncode == 0 and not result.timed_out
          and _lines(result.stdout) == _lines(expected))


def code_tests_reward(completion: str, tests: str | Sequence[Mapping[str, str]]) -> float:
  """The fraction of test cases the completion's program passes."""
  code = extract_code(completion)
  cases = _cases(tests)
  return sum(_passes(code, stdin, expected) for stdin, expected in cases) / len(cases)


def code_tests_all_reward(completion: str,
                          tests: str | Sequence[Mapping[str, str]]) -> float:
  """1.0 if the completion's program passes every test case, else 0.0.

  Stops at the first failing case.
  """
  code = extract_code(completion)
  return float(all(_passes(code, stdin, expected) for stdin, expected in _cases(tests)))
