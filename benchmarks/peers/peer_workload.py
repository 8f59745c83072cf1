"""What the peer scripts (`trl_grpo.py`, `tunix_grpo.py`) share: the GRPO workload
constants (`benchmarks/grpo_step.py`'s, and the `REAL_*` ones of
`benchmarks/real_model.py`'s), its prompts and a tokenizer of ids as decimal words.

Imported as a sibling module (the scripts run as files, each in its own virtualenv,
so this file imports neither the project nor either peer).
"""

import numpy as np
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

WARMUP = 2  # Untimed first steps, as benchmarks/grpo_step.py.
PROMPTS, PROMPT_LEN, GROUP, NEW_TOKENS = 16, 16, 4, 64
VOCAB, FIRST_ID, INIT_STD = 256, 3, 0.02
STOP = "<stop>"  # Id VOCAB, outside the model's vocab: never sampled, never fed as pad.
# benchmarks/real_model.py's workload: SmolLM2-135M's shapes, 8 prompts of 40 ids.
REAL_PROMPTS, REAL_PROMPT_LEN, REAL_VOCAB = 8, 40, 49152


def make_tokenizer(vocab: int = VOCAB) -> transformers.PreTrainedTokenizerFast:
  """Ids as decimal words split on whitespace; no BOS/EOS added, so text <-> ids.

  Eos and pad are STOP (id `vocab`): the peers stop a sequence at the eos id and mask
  completion ids equal to the pad id, so both must lie outside what the model can
  emit (an in-vocab pad word such as "0" would also be an added token, which splits
  "200" into 2 0 0). With every prompt 16 ids and every completion 64 there is nothing
  to pad.
  """
  vocab = {str(i): i for i in range(vocab)} | {STOP: vocab}
  tok = Tokenizer(models.WordLevel(vocab, unk_token=STOP))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=STOP,
                                              pad_token=STOP, padding_side="left")


def prompt_ids(seed: int, n: int, prompt_len: int = PROMPT_LEN,
               vocab: int = VOCAB) -> list[list[int]]:
  """Prompt i from (seed, i) alone, as the library's stream (`RandomPrompts`, worker 0)."""
  return [np.random.default_rng([seed + 1000, i]).integers(FIRST_ID, vocab, prompt_len).tolist()
          for i in range(n)]


def even_fraction(ids) -> float:
  """The reward: the share of even ids in a completion."""
  return sum(int(i) % 2 == 0 for i in ids) / len(ids)
