"""BUILD names every module, test and script, and no file that does not exist.

BUILD is Starlark, a subset of Python, so `ast` reads it and these checks need no bazel.
When bazel is on PATH, `bazel query //...` must also succeed; it runs offline (see the
note at the top of BUILD): `apt-get install -y bazel-bootstrap` provides it on Debian.
"""

import ast
import dataclasses
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "BUILD"
RULES = ("filegroup", "py_binary", "py_library", "py_test")
OTHER_CALLS = ("exports_files", "load", "package")  # Allowed at top level, not checked.
SIZES = ("small", "medium", "large", "enormous")
SCRIPT_DIRS = ("benchmarks", "launch")  # One py_binary per .py file, `__init__.py` aside.
HELPER_DIRS = ("benchmarks", "configs", "examples", "launch", "tests")  # Every .py there is in a target.


@dataclasses.dataclass
class Target:
  kind: str
  name: str
  line: int
  attrs: dict  # Attribute -> list of strings written out (a string attribute is a 1-list).
  globs: dict  # Attribute -> list of glob calls, each a tuple of patterns.

  def files(self, *attrs, with_globs=False):
    """Files named by `attrs` (labels of targets left out), globs expanded if asked."""
    out = set()
    for attr in attrs:
      out.update(s for s in self.attrs.get(attr, []) if not _is_label(s))
      if with_globs:
        for patterns in self.globs.get(attr, []):
          out.update(_glob(*patterns))
    return out


def _is_label(s):
  return s.startswith((":", "//", "@"))


def _glob(*patterns):
  return {p.relative_to(ROOT).as_posix() for pattern in patterns for p in ROOT.glob(pattern)
          if p.is_file() and "__pycache__" not in p.parts}


def _eval(node):
  """A Starlark expression in BUILD -> (strings, glob calls as tuples of patterns)."""
  if isinstance(node, ast.Constant) and isinstance(node.value, str):
    return [node.value], []
  if isinstance(node, ast.List):  # Of strings only: `[...] + glob([...])` joins the two.
    strings = [_eval(elt)[0] for elt in node.elts]
    for elt, s in zip(node.elts, strings):
      assert len(s) == 1, f"BUILD:{elt.lineno}: a list holds strings, not {ast.unparse(elt)!r}"
    return [s for s, in strings], []
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
    (s1, g1), (s2, g2) = _eval(node.left), _eval(node.right)
    return s1 + s2, g1 + g2
  if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
      and node.func.id == "glob" and len(node.args) == 1 and not node.keywords):
    patterns, nested = _eval(node.args[0])
    assert not nested, f"BUILD:{node.lineno}: glob inside glob"
    return [], [tuple(patterns)]
  raise AssertionError(f"BUILD:{node.lineno}: test_build.py cannot read {ast.unparse(node)!r}")


def _parse():
  targets = []
  for stmt in ast.parse(BUILD.read_text(), filename=str(BUILD)).body:
    assert (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Name)), (
                f"BUILD:{stmt.lineno}: only top-level rule calls are supported")
    call = stmt.value
    kind = call.func.id
    if kind in OTHER_CALLS:
      continue
    assert kind in RULES, f"BUILD:{stmt.lineno}: unexpected rule {kind}; known: {RULES}"
    assert not call.args, f"BUILD:{stmt.lineno}: {kind} takes keyword arguments only"
    attrs, globs = {}, {}
    for kw in call.keywords:
      if isinstance(kw.value, ast.Constant) and not isinstance(kw.value.value, str):
        continue  # Booleans and numbers (e.g. flaky = True, shard_count = 2).
      attrs[kw.arg], globs[kw.arg] = _eval(kw.value)
    name = attrs.get("name", [None])[0]
    assert name, f"BUILD:{stmt.lineno}: {kind} without a name"
    targets.append(Target(kind, name, stmt.lineno, attrs, globs))
  return targets


@pytest.fixture(scope="module")
def targets():
  return _parse()


def _py_files(*dirs, recursive=False):
  out = set()
  for d in dirs:
    out |= _glob(f"{d}/**/*.py" if recursive else f"{d}/*.py")  # ** matches no dir too.
  return out


def _of_kind(targets, kind):
  return [t for t in targets if t.kind == kind]


def test_target_names_are_unique(targets):
  names = [t.name for t in targets]
  assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_every_module_is_in_a_py_library(targets):
  libraries = _of_kind(targets, "py_library")
  for lib in libraries:  # A glob would pass the check below whatever the tree holds.
    assert not lib.globs.get("srcs"), f"py_library {lib.name}: list srcs, no glob"
  listed = set().union(*(lib.files("srcs") for lib in libraries))
  missing = sorted(_py_files("async_rl", recursive=True) - listed)
  assert not missing, f"add to a py_library's srcs in BUILD: {missing}"


def test_every_test_file_has_a_py_test(targets):
  tests = {t.name: t for t in _of_kind(targets, "py_test")}
  for path in sorted(_glob("tests/test_*.py")):
    stem = Path(path).stem
    assert stem in tests, f"add py_test(name = {stem!r}, srcs = [{path!r}], ...) to BUILD"
    assert path in tests[stem].files("srcs"), f"py_test {stem}: srcs lacks {path}"


def test_py_tests_are_well_formed(targets):
  for t in _of_kind(targets, "py_test"):
    srcs = t.files("srcs")
    assert not t.globs.get("srcs"), f"py_test {t.name}: list srcs, no glob"
    assert f"tests/{t.name}.py" in srcs or t.attrs.get("main"), (
        f"py_test {t.name}: srcs has no tests/{t.name}.py and no main is given")
    assert t.attrs.get("size", [None])[0] in SIZES, f"py_test {t.name}: size one of {SIZES}"


def test_every_script_has_a_py_binary(targets):
  binaries = _of_kind(targets, "py_binary")
  entry_points = {}
  for b in binaries:
    assert not b.globs.get("srcs"), f"py_binary {b.name}: list srcs, no glob"
    main = b.attrs.get("main", [f"{b.name}.py"])[0]
    matches = [s for s in b.files("srcs") if s == main or s.endswith("/" + main)]
    assert len(matches) == 1, f"py_binary {b.name}: main {main!r} is not one of its srcs"
    entry_points[matches[0]] = b.name
  scripts = {p for p in _py_files(*SCRIPT_DIRS) if Path(p).name != "__init__.py"}
  missing = sorted(scripts - set(entry_points))
  assert not missing, f"add a py_binary (main = the file) to BUILD for each of {missing}"


def test_every_helper_file_is_in_a_target(targets):
  # Globs count in filegroups only: test_build's data globs the whole tree.
  named = set().union(*(t.files("srcs", "data", with_globs=t.kind == "filegroup")
                        for t in targets))
  missing = sorted(_py_files(*HELPER_DIRS) - named)
  assert not missing, f"name these in BUILD (a py_test's data or srcs, say): {missing}"


def test_no_target_names_a_missing_file_or_target(targets):
  names = {t.name for t in targets}
  for t in targets:
    for attr, values in t.attrs.items():
      if attr not in ("srcs", "data", "main", "deps"):
        continue
      for value in values:
        if value.startswith(":"):
          assert value[1:] in names, f"{t.kind} {t.name}: {attr} names no target {value}"
        elif value.startswith("//:"):
          assert value[3:] in names, f"{t.kind} {t.name}: {attr} names no target {value}"
        elif _is_label(value):
          pass  # Another package or repository: nothing here to check it against.
        elif attr == "main":
          assert any(s == value or s.endswith("/" + value) for s in t.files("srcs")), (
              f"{t.kind} {t.name}: main {value} is not one of its srcs")
        else:
          assert (ROOT / value).is_file(), f"{t.kind} {t.name}: {attr} names missing {value}"
    for attr, calls in t.globs.items():
      for patterns in calls:  # Bazel's --incompatible_disallow_empty_glob would reject it.
        assert _glob(*patterns), f"{t.kind} {t.name}: glob{patterns} in {attr} matches nothing"


def test_srcs_lists_are_sorted(targets):
  for t in targets:
    srcs = t.attrs.get("srcs", [])
    assert srcs == sorted(srcs), f"{t.kind} {t.name}: sort srcs"


def test_bazel_query_lists_every_target(targets):
  bazel = shutil.which("bazel")
  if bazel is None:
    pytest.skip("bazel is not on PATH (Debian: apt-get install -y bazel-bootstrap)")
  if "TEST_SRCDIR" in os.environ:
    pytest.skip("running under bazel test: no bazel inside bazel")
  # --batch: no server left running; its own output root: nothing written under ~/.cache.
  user_root = tempfile.mkdtemp(prefix="bazel-root-")
  try:
    out = subprocess.run(
        [bazel, "--batch", f"--output_user_root={user_root}", "query", "//...",
         "--output=label_kind"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  finally:
    _remove_tree(user_root)
  assert out.returncode == 0, out.stderr[-4000:]
  listed = {tuple(line.split(" rule ")) for line in out.stdout.splitlines() if " rule " in line}
  expected = {(t.kind, f"//:{t.name}") for t in targets}
  assert expected <= listed, sorted(expected - listed)
  assert any(kind == "py_test" for kind, _ in listed)


def _remove_tree(root):
  """Bazel leaves read-only directories in its output root: make them writable first."""
  os.chmod(root, 0o755)
  for dirpath, dirnames, _ in os.walk(root):  # Top down, so each is opened after its chmod.
    for d in dirnames:
      path = os.path.join(dirpath, d)
      if not os.path.islink(path):  # chmod would follow the link out of the tree.
        os.chmod(path, 0o755)
  shutil.rmtree(root, ignore_errors=True)
