"""BUILD is what tools/gen_build.py writes from the imports, and Bazel reads it.

When bazel is on PATH, `bazel query //...` must succeed; it runs offline (see the note
at the top of BUILD): `apt-get install -y bazel-bootstrap` provides it on Debian.
"""

import ast
import os
import shutil
import subprocess
import tempfile

import pytest

from tools import gen_build

# Under `bazel test` the runfiles hold the test's own inputs, not the tree BUILD describes.
_UNDER_BAZEL = "TEST_SRCDIR" in os.environ


@pytest.mark.skipif(_UNDER_BAZEL, reason="BUILD is checked against the source tree")
def test_build_is_generated_from_the_tree():
  stale = gen_build.diff()
  assert not stale, f"BUILD is stale: run `{gen_build.COMMAND}`\n{stale}"


def _words(code):
  return sorted(gen_build._strings(ast.parse(code)))


def test_strings_split_into_names_and_join_path_chains():
  # Names of no file here, so that this file's own BUILD rule does not list them.
  assert _words('"""A docstring names docs/x.md."""\n'
                'ROOT / "doc" / "guide.md"\n'
                'run("-m launch.nowhere --config=conf/none.py:variant")') == sorted([
                    ("doc/guide.md", True), ("doc", False), ("guide.md", False),
                    ("-m", False), ("launch.nowhere", False), ("--config", False),
                    ("conf/none.py", False), ("variant", False)])
  assert _words('Path(__file__).parent / "examples" / name') == [("examples", False)]
  assert _words("f'--workdir={tmp}/x.py'") == [("--workdir", False), ("/x.py", False)]


def test_a_check_script_brings_what_it_needs_to_the_test_that_runs_it():
  repo = gen_build.Repository()
  check = next(p for p in repo.test_helpers if p.endswith("_check.py"))
  runner = gen_build.Needs()
  repo._add_path(runner, check, "tests/test_runner.py")
  assert check in runner.data
  assert repo.needs(check).deps <= runner.deps and repo.needs(check).data <= runner.data


def test_bazel_query_lists_every_target():
  bazel = shutil.which("bazel")
  if bazel is None:
    pytest.skip("bazel is not on PATH (Debian: apt-get install -y bazel-bootstrap)")
  if _UNDER_BAZEL:
    pytest.skip("running under bazel test: no bazel inside bazel")
  # --batch: no server left running; its own output root: nothing written under ~/.cache.
  user_root = tempfile.mkdtemp(prefix="bazel-root-")
  try:
    out = subprocess.run(
        [bazel, "--batch", f"--output_user_root={user_root}", "query", "//...",
         "--output=label_kind"],
        cwd=gen_build.ROOT, capture_output=True, text=True, timeout=300, check=False)
  finally:
    _remove_tree(user_root)
  assert out.returncode == 0, out.stderr[-4000:]
  listed = {tuple(line.split(" rule ")) for line in out.stdout.splitlines() if " rule " in line}
  expected = {(r.kind, f"//:{r.name}") for r in gen_build.rules(gen_build.Repository())}
  assert listed == expected, sorted(listed ^ expected)


def _remove_tree(root):
  """Bazel leaves read-only directories in its output root: make them writable first."""
  os.chmod(root, 0o755)
  for dirpath, dirnames, _ in os.walk(root):  # Top down, so each is opened after its chmod.
    for d in dirnames:
      path = os.path.join(dirpath, d)
      if not os.path.islink(path):  # chmod would follow the link out of the tree.
        os.chmod(path, 0o755)
  shutil.rmtree(root, ignore_errors=True)
