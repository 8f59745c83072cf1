"""The binaries as a user meets them: shipped configs by name, the console scripts of a
wheel installed into a fresh virtualenv and run outside the repository, and serving a
Hugging Face directory through its own tokenizer."""

import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from async_rl import configs
from conftest import one_layer_model

ROOT = Path(__file__).parents[1]
SCRIPTS = ("async-rl-train", "async-rl-eval", "async-rl-export", "async-rl-serve")


def _run(cmd, cwd, env=None, timeout=300):
  return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                        env=env or dict(os.environ, PYTHONPATH=str(ROOT)))


def test_a_config_name_is_its_shipped_file_and_a_path_stays(monkeypatch):
  monkeypatch.chdir(ROOT)
  shipped = Path(configs.__file__).parent
  assert set(configs.names()) >= {"micro", "tiny"}
  assert configs.names() == tuple(sorted(p.stem for p in (ROOT / "configs").glob("*.py")
                                         if p.stem != "__init__"))
  assert configs.config_file("micro") == str(shipped / "micro.py")
  assert configs.config_file("tiny:long_reasoning") == f"{shipped / 'tiny.py'}:long_reasoning"
  assert configs.config_file("configs/tiny.py:tool") == "configs/tiny.py:tool"
  with pytest.raises(ValueError, match="no shipped config 'mirco'.*micro, .*tiny"):
    configs.config_file("mirco")
  with pytest.raises(ValueError, match="no config file 'configs/nope.py'.*: micro, "):
    configs.config_file("configs/nope.py")


def test_config_errors_are_one_line_and_a_variant_loads_by_name():
  for flag, message in (("--config=mirco", "--config: no shipped config 'mirco'; the "
                         "shipped configs, by name: micro, "),
                        ("--config=tiny:nonesuch", "ValueError: configs/tiny.py has variants "
                         "('tool', 'long_tail', 'long_reasoning'), got 'nonesuch'")):
    out = _run([sys.executable, "-m", "launch.train", flag, "--workdir=unused"], ROOT)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
  # The same experiment by name and by path, each with its variant.
  printed = [_run([sys.executable, "-m", "launch.train", *flags, "--print_config"], ROOT)
             for flags in (["--config=tiny:long_reasoning"],
                           ["--config=configs/tiny.py:long_reasoning"], ["--config", "tiny"])]
  assert all(out.returncode == 0 for out in printed), printed[0].stderr[-3000:]
  assert "generation.max_new_tokens: int = 1024" in printed[0].stdout
  assert printed[0].stdout == printed[1].stdout != printed[2].stdout


def _untracked(directory, names):
  """What `.gitignore` leaves out of the repository (and .git itself)."""
  everywhere = {".git", "__pycache__", ".pytest_cache", ".hypothesis"}
  at_root = Path(directory) == ROOT
  return [n for n in names if n in everywhere or n.endswith(".egg-info") or (
      at_root and (n == "build" or n.startswith(("bazel-", "workdir"))))]


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
  """A virtualenv holding async_rl built from a copy of this tree (links included),
  nothing downloaded: its dependencies are this interpreter's, through a .pth file that
  names its site-packages (`--system-site-packages` alone would give the base
  interpreter's when the tests run in a virtualenv)."""
  base = tmp_path_factory.mktemp("install")
  src = base / "src"
  shutil.copytree(ROOT, src, symlinks=True, ignore=_untracked)
  subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                  str(base / "venv")], check=True, timeout=120)
  python = base / "venv" / "bin" / "python"
  inner = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                         capture_output=True, text=True, check=True, timeout=60).stdout.strip()
  Path(inner, "outer_site_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
  out = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps",
                        "--no-build-isolation", "--no-index", str(src)],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return base / "venv" / "bin"


def _outside(tmp_path):
  """A working directory outside the repository, and an environment that does not
  point into it."""
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
  return tmp_path, env


def test_installed_console_scripts_run_outside_the_repository(venv, tmp_path):
  cwd, env = _outside(tmp_path)
  out = _run([str(venv / "python"), "-c", "import async_rl; print(async_rl.__file__)"], cwd, env)
  installed = Path(out.stdout.strip()).parent
  assert installed.is_relative_to(venv.parent), out.stdout + out.stderr
  # The clone's launch/ and configs/ links are not packages of their own.
  assert {"launch", "configs"}.isdisjoint(os.listdir(installed.parent))

  for script, docstring, flag in (
      ("async-rl-train", "Asynchronous RL training binary.", "--coordinator_address"),
      ("async-rl-eval", "Scores a policy on its task's held-out set", "--pass_k"),
      ("async-rl-export", "Exports a run's trained policy", "--out"),
      ("async-rl-serve", "Serves a policy, a run's checkpoint or a Hugging Face model", "--prompt"),
      ("async-rl-fetch", "Fetches a shipped pretrained model", "--model")):
    out = _run([str(venv / script), "--help"], cwd, env)
    assert out.stdout.startswith(docstring) and f"  {flag}:" in out.stdout, out.stdout[-3000:]
    assert "--config: The experiment: a shipped config's name" in out.stdout or (
        script in ("async-rl-export", "async-rl-fetch"))

  out = _run([str(venv / "async-rl-train"), "--config=tiny:long_reasoning", "--print_config"],
             cwd, env)
  assert "generation.max_new_tokens: int = 1024" in out.stdout, out.stderr[-3000:]

  workdir = tmp_path / "run"
  out = _run([str(venv / "async-rl-train"), "--config=micro", f"--workdir={workdir}",
              "--config.num_steps=1"], cwd, env, timeout=600)
  assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
  assert "v=1 reward=" in out.stdout and "eval v=1" in out.stdout
  steps = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [s["step"] for s in steps if "eval" not in s] == [1]
  assert sorted(os.listdir(tmp_path)) == ["run"]  # nothing written to the working directory


requires_serving = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("jetstream", "tokenizers", "safetensors")),
    reason="serving a Hugging Face directory needs the jetstream and hf extras")


@requires_serving
def test_serve_completes_prompts_with_a_hugging_face_model_and_its_tokenizer(tmp_path):
  from async_rl.models.hf_tokenizer import HFTokenizer  # noqa: PLC0415 - the hf extra
  from hf_test_utils import load_hf, our_logits, write_model_dir  # noqa: PLC0415
  model_dir = tmp_path / "model"
  write_model_dir(model_dir, one_layer_model(64), seed=3)
  # Letters: the arithmetic task's character tokenizer would refuse them.
  prompts, max_tokens = ["what is two plus two", "the answer is"], 6
  tokenizer = HFTokenizer(str(model_dir))
  cfg, params = load_hf(model_dir)
  expected = []
  for prompt in prompts:
    tokens = tokenizer.encode(prompt)  # no BOS: the tokenizer has none
    completion = []
    for _ in range(max_tokens):
      token = int(np.argmax(our_logits(cfg, params, tokens + completion)[-1]))
      if token in tokenizer.stop_ids:
        break
      completion.append(token)
    expected.append(completion)

  out = _run([sys.executable, "-m", "launch.serve_jetstream", "--config=micro",
              f"--config.hf_model_dir={model_dir}", *(f"--prompt={p}" for p in prompts),
              f"--max_tokens={max_tokens}"], ROOT)
  assert out.returncode == 0, out.stderr[-4000:]
  served = json.loads(out.stdout.strip().splitlines()[-1])
  assert [s["prompt"] for s in served] == prompts
  assert [s["token_ids"] for s in served] == expected
  # JetStream streams the text a token at a time.
  assert [s["text"] for s in served] == ["".join(tokenizer.decode([t]) for t in ids)
                                          for ids in expected]


def test_serve_names_what_it_needs():
  out = _run([sys.executable, "-m", "launch.serve_jetstream", "--prompt=1+1="], ROOT)
  assert out.returncode != 0 and "give --workdir" in out.stderr, out.stderr[-3000:]
  out = _run([sys.executable, "-m", "launch.serve_jetstream", "--config=micro",
              "--prompt=1+1="], ROOT)
  assert out.returncode == 1 and "serve: nothing to serve" in out.stderr, out.stderr[-3000:]
