"""Tiny Hugging Face models and tokenizers, and GSM8K-style JSONL files, built offline.

torch, transformers and tokenizers are imported where used: each test module skips
itself first when the one it needs is missing.
"""

import json

import jax
import numpy as np

from async_rl import models, sharding
from async_rl.config import ModelConfig
from async_rl.models import hf, hf_config

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rms_norm_eps=1e-5, initializer_range=0.1)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["what is two plus two", "the answer is four", "system user assistant",
          "please reason step by step"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
# GSM8K-style rows; MATH_HELDOUT[0] asks MATH_TRAIN[6]'s question.
MATH_TRAIN = [{"question": f"what is {a} plus {b}", "answer": f"{a} plus {b} is\n#### {i + j + 2}"}
              for i, a in enumerate(NUMBERS[:4]) for j, b in enumerate(NUMBERS[:4])]
MATH_HELDOUT = [{"question": "what is two plus three", "answer": "5"},
                {"question": "what is nine plus one", "answer": "#### 10"}]
# The words of those questions and of the default system prompt.
MATH_CORPUS = CORPUS + [" ".join(NUMBERS + [
    "what", "is", "plus", "Please", "reason", "step", "by", ",", "and", "put", "your", "final",
    "answer", "within", "boxed"])]
_forward = jax.jit(models.forward, static_argnums=1)


def torch_model(hf_config, seed=0):
  """A random float32 `transformers` model of `hf_config`, in eval mode."""
  import torch
  import transformers
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
  # Random init leaves norms at 1 and biases at 0; perturb them so the test sees them.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.add_(0.3 * torch.randn_like(p))
  return model.eval()


def torch_logits(model, tokens_T):
  import torch
  with torch.no_grad():
    return model(torch.tensor(tokens_T)[None]).logits[0].numpy()


def our_logits(cfg, params, tokens_T):
  n = len(tokens_T)
  out = _forward(params, cfg, np.asarray(tokens_T)[None], np.arange(n)[None],
                 np.ones((1, n), np.int32))
  return np.asarray(out)[0]


def save_tokenizer(model_dir, specials=SPECIALS, corpus=CORPUS):
  """A word-level `tokenizer.json` over `corpus` plus `specials`; returns the Tokenizer."""
  from tokenizers import Tokenizer, models as tok_models, pre_tokenizers, trainers
  tok = Tokenizer(tok_models.WordLevel(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
  tok.add_special_tokens(specials)
  tok.save(str(model_dir / "tokenizer.json"))
  return tok


def write_model_dir(model_dir, cfg: ModelConfig, corpus=CORPUS, seed=0):
  """A Hugging Face directory made without torch: random params of `cfg` (`save_hf`)
  and a word-level tokenizer over `corpus` whose EOS is <|im_end|>; returns the
  Tokenizer."""
  model_dir.mkdir(parents=True, exist_ok=True)
  hf.save_hf(cfg, models.init_params(cfg, jax.random.key(seed)), str(model_dir))
  (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
  return save_tokenizer(model_dir, corpus=corpus)


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def load_hf(model_dir, mesh=None, dtype=None):
  """(config, params) of a Hugging Face directory, as the builder loads them: the
  architecture from its config.json, the weights onto `mesh`'s param shardings."""
  cfg = ModelConfig(**hf_config.read_config(str(model_dir), dtype=dtype))
  shardings = None
  if mesh is not None:
    shardings = sharding.param_shardings(models.abstract_params(cfg), mesh)
  return cfg, hf.load_hf(str(model_dir), cfg, shardings=shardings)
