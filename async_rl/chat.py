"""Conversations as text: ChatML, and a model's Jinja chat template compiled as
transformers compiles it.

A conversation is a list of messages, each a mapping with a "role" ("system",
"user", "assistant", ...) and a "content" string: TRL's conversational format.
"""

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Optional

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"


def chatml(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
  """ChatML: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then
  `<|im_start|>assistant\\n` where the assistant begins (with `add_generation_prompt`).
  This is what Qwen2.5's template renders for a conversation that starts with a system
  message, without tools."""
  text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
  return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def chat_messages(question: str, system: Optional[str] = None) -> list[dict[str, str]]:
  """One user turn, after a system turn unless `system` is None."""
  turns = [] if system is None else [{"role": "system", "content": system}]
  return turns + [{"role": "user", "content": question}]


def compile_chat_template(template: str):
  """A Jinja chat template compiled as transformers compiles it: a sandbox with
  `trim_blocks` and `lstrip_blocks`, loop controls, a `tojson` that does not escape
  HTML, `raise_exception(message)`, `strftime_now(format)`, and `{% generation %}`
  blocks rendered as their contents (they only mark the assistant's tokens).

  Raises:
    jinja2.TemplateError: the template does not parse.
  """
  import jinja2  # Installed with the `hf` extra; imported where a template is compiled.
  from jinja2 import ext, nodes, sandbox

  class Generation(ext.Extension):
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller):
      return caller()

  def raise_exception(message):
    raise jinja2.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[Generation, ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals.update(raise_exception=raise_exception,
                     strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
  return env.from_string(template)
