"""Every run-level path on a real model: the shipped SmolLM2 cut to its first two blocks
(`conftest.smollm2_two_blocks`: its own 49,152-token vocabulary, byte-level BPE
tokenizer and chat template), on the chat arithmetic task of `configs/smollm2.py`.

The recipe's own config, shortened, runs the asynchronous loop at η = 0 (with top-k /
top-p sampling: the trainer scores the truncated support, and behaviour and recomputed
log-probs agree) and at η = 1; `async-rl-eval` scores its checkpoint strictly and
leniently; `async-rl-serve --openai` answers the real `openai` client's chat
completions through the model's template, streamed and not; and an agent's episode over
chat messages records the environment's tokens as the template renders them, masked.
"""

import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf", reason="GGUF files need the hf extra")
pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import jax  # noqa: E402

from async_rl import cli, policy  # noqa: E402
from async_rl.agents.episode import LOSSES  # noqa: E402
from async_rl.agents.server import Endpoint  # noqa: E402
from async_rl.agents.task import AgentWorkflow  # noqa: E402
from async_rl.configs import smollm2  # noqa: E402
from async_rl.generation import Request, SamplingParams  # noqa: E402
from async_rl.models import hf  # noqa: E402
from async_rl.rl import build, entry  # noqa: E402
from async_rl.rl.episodes import EpisodeRunner  # noqa: E402
from async_rl.tasks.registry import make_task  # noqa: E402

ROOT = Path(__file__).parents[1]
ETAS = (0, 1)


def _config(model_dir, **overrides):
  """configs/smollm2.py on `model_dir`, shortened: two steps of two groups of two, eight
  new tokens, four held-out prompts."""
  c = smollm2.get_config()
  c.hf_model_dir = model_dir
  c.num_steps, c.batch_groups = 2, 2
  c.model.max_seq_len = 88
  c.generation.update(max_new_tokens=8, group_size=2, num_slots=4)
  c.batching.max_tokens_per_mb = 176
  c.staleness.max_concurrent = 4
  c.eval.update(num_prompts=4, every_steps=0)
  c.checkpoint.every_steps = 2
  c.log.samples_every = 1
  for key, value in overrides.items():
    section, field = key.split(".")
    c[section][field] = value
  return cli.from_dict(c)


@pytest.fixture(scope="module")
def runs(smollm2_two_blocks, tmp_path_factory):
  """η -> (workdir, summary, echoed lines) of a two-step run. η = 0 is synchronous
  (`drain`) with top-k / top-p sampling; η = 1 is the recipe's own asynchronous loop."""
  _, model_dir = smollm2_two_blocks
  out = {}
  for eta in ETAS:
    overrides = {"staleness.max_staleness": eta}
    if eta == 0:
      overrides.update({"generation.update_mode": "drain", "generation.top_k": 40,
                        "generation.top_p": 0.9})
    workdir = tmp_path_factory.mktemp(f"smollm2_eta{eta}")
    lines = []
    summary = entry.run(_config(model_dir, **overrides), str(workdir), progress=False,
                        echo=lines.append)
    out[eta] = workdir, summary, lines
  return out


@pytest.mark.parametrize("eta", ETAS)
def test_the_loop_trains_the_real_vocabulary_within_its_staleness_bound(runs, eta):
  workdir, summary, lines = runs[eta]
  assert (summary["start_version"], summary["end_version"]) == (0, 2)
  history = summary["history"]
  assert len(history) == 2
  for m in history:
    assert m["staleness_max"] <= eta and m["trained_tokens"] > 0
    # Behaviour log-probs under the version being trained agree with the trainer's
    # recompute, on the support they were drawn from when sampling is truncated.
    assert m["mismatch_abs_max"] <= policy.LOGP_ROUNDING["float32"]
    if eta == 0:
      assert m["mismatch_tokens"] == m["trained_tokens"]
  for when in ("before", "after"):
    held_out = summary[f"eval_{when}"]
    assert 0 <= held_out["accuracy"] <= 1 and 0 <= held_out["accuracy_lenient"] <= 1
    assert held_out["too_long"] == 0 and held_out["rewards"]["errors"] == 0
  assert sum(line.count("accuracy_lenient=") for line in lines) == 2
  # The completions logged are text without the template's special tokens.
  samples = [json.loads(line) for line in (workdir / "samples.jsonl").read_text().splitlines()]
  assert samples and all("<|im" not in s["completion"] for s in samples)


def _binary(*args, **kw):
  return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), **kw)


def test_eval_binary_scores_the_checkpoint_strictly_and_leniently(runs):
  workdir, _, _ = runs[1]
  out, err = _binary("launch.eval", f"--workdir={workdir}", "--num_prompts=3",
                     "--pass_k=0").communicate(timeout=600)
  assert out, err[-3000:]
  report = json.loads(out.strip().splitlines()[-1])
  assert (report["step"], report["task"], report["num_prompts"]) == (2, "arithmetic_chat", 3)
  assert report["reward_calls"] == 3 * 2  # the strict and the lenient score, greedy only
  assert "pass_at_1" not in report and 0 <= report["accuracy_lenient"] <= 1


def test_serve_answers_chat_completions_through_the_models_template(runs, smollm2_two_blocks):
  workdir, _, _ = runs[1]
  _, model_dir = smollm2_two_blocks
  # History, multi-byte text, and no system turn: the template writes its own.
  messages = [{"role": "user", "content": "Héllo 🙂"}, {"role": "assistant", "content": "Hi!"},
              {"role": "user", "content": "What is 2 + 3?"}]
  expected_prompt = transformers.AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
      messages, add_generation_prompt=True, tokenize=True, return_dict=False)
  server = _binary("launch.serve_jetstream", "--openai", f"--workdir={workdir}", "--port=0",
                   "--max_tokens=12")
  try:
    base_url = json.loads(server.stdout.readline())["base_url"]
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    ask = dict(model="m", messages=messages, max_tokens=12, temperature=0.0)
    whole = client.chat.completions.create(**ask)
    streamed = [c.choices[0].delta.content or "" for c in
                client.chat.completions.create(**ask, stream=True) if c.choices]
  finally:
    server.send_signal(signal.SIGTERM)
    _, err = server.communicate(timeout=120)
  assert server.returncode == 0, err[-3000:]
  assert whole.usage.prompt_tokens == len(expected_prompt)
  reply = whole.choices[0].message.content
  assert "".join(streamed) == reply and whole.choices[0].finish_reason in ("stop", "length")
  assert "<|im_end|>" not in reply and "<|im_start|>" not in reply
  assert 0 < whole.usage.completion_tokens <= 12


FOLLOW_UP = "Are you sure?"


async def _asks_twice(client, row):
  """Asks the task's question, then asks again after the reply; keeps the replies."""
  messages = list(row)
  for _ in range(2):
    out = await client.chat.completions.create(model="m", messages=messages, max_tokens=8)
    messages += [{"role": "assistant", "content": out.choices[0].message.content},
                 {"role": "user", "content": FOLLOW_UP}]
  _asks_twice.conversations.append(messages[:-1])
  return 0.5


def test_an_agent_episode_over_chat_messages_masks_what_the_template_writes(
    smollm2_two_blocks):
  _, model_dir = smollm2_two_blocks
  # Room for the second turn's prompt: the first, a reply and the follow-up.
  cfg = build.resolve(_config(model_dir, **{"model.max_seq_len": 128,
                                            "generation.max_prompt_len": 120}))
  task = make_task(cfg.task)
  tok = task.tokenizer
  reference = transformers.AutoTokenizer.from_pretrained(model_dir)
  params = hf.load_hf(model_dir, cfg.model)
  problem = task.heldout(1)[0].problem
  prompt = types.SimpleNamespace(id="p", tokens=tuple(tok.encode(tok.render_chat(
      task.messages(problem)))), messages=task.messages(problem))
  _asks_twice.conversations = []
  endpoint = Endpoint(tok)
  workflow = AgentWorkflow(endpoint, _asks_twice, row=lambda p: p.messages, deadline_s=300)
  with build.make_pool([build.make_engine(cfg)], params) as pool:
    runner = EpisodeRunner(pool, workflow, vocab_size=cfg.model.vocab_size)
    try:
      episodes = runner.submit(prompt, Request("p", list(prompt.tokens), 2, SamplingParams(
          temperature=1.0, max_new_tokens=40, seed=3, stop_token_ids=tok.stop_ids))
                               ).result(timeout=600)
      counts = runner.metrics()
    finally:
      runner.close()
      workflow.close()
      endpoint.close()
  assert counts == {"agent_episodes": 2, **{f"agent_lost_{r}": 0 for r in LOSSES}}
  logp = jax.jit(policy.logp_and_entropy, static_argnums=1, static_argnames="temperature")
  for e, conversation in zip(episodes, _asks_twice.conversations):
    assert e.reward == 0.5 and e.metadata["turns"] == 2
    policy_T = e.versions_T >= 0
    np.testing.assert_array_equal(e.loss_mask_T, policy_T)
    # Up to the last reply, the episode is the template's rendering of the conversation
    # so far, as transformers renders it: the prompt, the first reply as generated (its
    # own token ids, which may not be how the reply's text would encode), then the
    # environment's tokens, untrained: the template's text between that reply and the
    # next generation prompt (the end of the turn, the follow-up), encoded as the
    # tokenizer encodes it.
    prompt, first = conversation[:-3], conversation[-3]["content"]
    last = np.flatnonzero(~policy_T)[-1] + 1  # where the last reply begins
    rendered = reference.apply_chat_template(conversation[:-1], add_generation_prompt=True,
                                             tokenize=False)
    assert reference.decode(e.tokens_T[:last]) == rendered
    prompt_text = reference.apply_chat_template(prompt, add_generation_prompt=True,
                                                tokenize=False)
    assert e.tokens_T[:e.prompt_len].tolist() == reference.encode(prompt_text,
                                                                  add_special_tokens=False)
    between_T, generated_T = e.tokens_T[e.prompt_len:last], policy_T[e.prompt_len:last]
    # The end of the reply's turn is the environment's unless the policy generated it.
    env = rendered[len(prompt_text) + len(first):]
    if between_T[generated_T][-1] == tok.eos_id:
      env = env.removeprefix("<|im_end|>")
    assert between_T[~generated_T].tolist() == reference.encode(env, add_special_tokens=False)
    assert env.endswith(f"<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(e.tokens_T[last:]) == conversation[-1]["content"]
    # Each policy token's behaviour log-prob is the model's, given the episode before it.
    n = len(e)
    logp_1T, _ = logp(params, cfg.model, e.tokens_T[None], np.arange(n)[None],
                      np.ones((1, n), np.int32), temperature=1.0)
    np.testing.assert_allclose(e.logp_T[policy_T], np.asarray(logp_1T)[0][policy_T],
                               atol=1e-4)
