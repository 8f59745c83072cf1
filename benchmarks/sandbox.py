"""Start-up cost of one sandboxed run (a code reward pays it once per test case).

  python -m benchmarks.sandbox                   # about 10 s
  python -m benchmarks.sandbox --before=43f51e6  # also the sandbox of that git commit

Times `run_sandboxed("pass")` (an empty program: so all of it is start-up and
tear-down) against the floor, the bare interpreter (`python -I -S -c pass`, run as
the sandbox's user), and, with `--before`, against `run_sandboxed` of the module
`async_rl/rewards/sandbox.py` as it was at that git commit (loaded from `git show`).
The variants take turns, `--runs` times each, after one warm-up run each (which pays
the sandbox's one-off probes); the table gives the median and the fastest run.
A float32 1024³ matmul measured in the same run tells how loaded the machine was.

Prints a table, then, as the last line, one JSON object with the medians in ms.
"""

import importlib.util
import json
import os
import statistics
import subprocess
import tempfile

from absl import app, flags

from async_rl.rewards import isolation, run_sandboxed
from benchmarks.common.peak import matmul_peak
from benchmarks.common.timer import timed

_RUNS = flags.DEFINE_integer("runs", 50, "Timed runs per variant.")
_BEFORE = flags.DEFINE_string("before", "", "A git commit whose sandbox to time too.")


def _module_at(commit: str):
  source = subprocess.run(["git", "show", f"{commit}:async_rl/rewards/sandbox.py"],
                          capture_output=True, text=True, check=True).stdout
  with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write(source)
  spec = importlib.util.spec_from_file_location(f"sandbox_{commit}", f.name)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  finally:
    os.unlink(f.name)
  return module


def _bare_interpreter():
  iso = isolation()
  user = {} if iso.user is None else dict(user=iso.user, group=iso.user, extra_groups=[])
  subprocess.run([iso.python, "-I", "-S", "-c", "pass"], check=True, cwd="/", **user)


def main(argv):
  del argv
  iso = isolation()
  if iso.missing:
    raise SystemExit(f"the full sandbox cannot run here: {iso.missing}")
  variants = {"python -I -S (floor)": _bare_interpreter,
              "run_sandboxed (bubblewrap)": lambda: run_sandboxed("pass")}
  if _BEFORE.value:
    before = _module_at(_BEFORE.value)
    variants[f"run_sandboxed at {_BEFORE.value}"] = lambda: before.run_sandboxed("pass")
  times = {name: [] for name in variants}
  for fn in variants.values():
    fn()
  for _ in range(_RUNS.value):
    for name, fn in variants.items():
      times[name].append(timed(fn)[1])
  gflops = matmul_peak(1024) / 1e9
  median = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
  print(f"interpreter {iso.python} as uid {iso.user}; seccomp filter: {iso.seccomp}; "
        f"float32 1024^3 matmul: {gflops:.1f} GFLOP/s\n")
  print("| variant | median ms | fastest ms | of floor |\n|---|---|---|---|")
  floor = median["python -I -S (floor)"]
  for name, ts in times.items():
    print(f"| {name} | {median[name]:.1f} | {1e3 * min(ts):.1f} | "
          f"{median[name] / floor:.2f}x |")
  summary = {"runs": _RUNS.value, "matmul_gflops": round(gflops, 1),
             "python_start_ms": round(floor, 2),
             "sandbox_start_ms": round(median["run_sandboxed (bubblewrap)"], 2)}
  if _BEFORE.value:
    summary["before_start_ms"] = round(median[f"run_sandboxed at {_BEFORE.value}"], 2)
    summary["after_over_before"] = round(summary["sandbox_start_ms"]
                                         / summary["before_start_ms"], 3)
  print(json.dumps(summary))


if __name__ == "__main__":
  app.run(main)
