"""Tiny Hugging Face models and tokenizers, built offline, for the HF tests.

torch, transformers and tokenizers are imported where used: each test module skips
itself first when the one it needs is missing.
"""

import jax
import numpy as np

from async_rl import models

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rms_norm_eps=1e-5, initializer_range=0.1)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["what is two plus two", "the answer is four", "system user assistant",
          "please reason step by step"]
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

