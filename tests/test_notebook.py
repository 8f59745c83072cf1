"""The notebooks run headless from top to bottom, every cell as written but for the run
lengths and the batch, which the tests shorten (a whole notebook takes minutes on a
2-core CPU; the code paths are the same at any length): notebooks/quickstart.ipynb, with
a reward function defined in one of its cells, and notebooks/real_model.ipynb, the
SmolLM2 recipe on the chat arithmetic task, run on the shipped model's first two blocks
(`conftest.smollm2_two_blocks`: its vocabulary, tokenizer and template; a whole run of
the 30 blocks adds minutes and no code path).

Needs the `notebook` extra (nbclient, nbformat, ipykernel, matplotlib); skipped without it.
"""

import re
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient", reason="needs nbclient (the notebook extra)")
nbformat = pytest.importorskip("nbformat", reason="needs nbformat (the notebook extra)")
pytest.importorskip("ipykernel", reason="needs ipykernel (the notebook extra)")
pytest.importorskip("matplotlib", reason="needs matplotlib (the notebook extra)")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOK = NOTEBOOKS / "quickstart.ipynb"
REAL_MODEL = NOTEBOOKS / "real_model.ipynb"


def _outputs(nb):
  return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]


@pytest.mark.parametrize("path", [NOTEBOOK, REAL_MODEL], ids=lambda p: p.name)
def test_notebook_is_saved_without_outputs(path):
  nb = nbformat.read(path, as_version=4)
  assert not _outputs(nb), "clear the notebook's outputs before saving it"


# The notebook's run lengths, and the shorter ones the test runs: a batch of 4 prompts
# (the tiny config's 32 otherwise), one evaluation and one checkpoint between the first
# and the last.
SHORTER = {"c = tiny.get_config()": "c = tiny.get_config()\nc.batch_groups = 4",
           "c.sft.steps = 100": "c.sft.steps = 4", "c.num_steps = 40": "c.num_steps = 4",
           "c.num_steps = 20": "c.num_steps = 2",
           "num_prompts=100, every_steps=20": "num_prompts=4, every_steps=2",
           "c.checkpoint.every_steps = 20": "c.checkpoint.every_steps = 2"}


def _shortened(nb, shorter=SHORTER):
  for cell in nb.cells:
    for long, short in shorter.items():
      if long in cell.source:
        cell.source = cell.source.replace(long, short)
        yield long


def test_quickstart_notebook_runs():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  assert sorted(_shortened(nb)) == sorted(SHORTER), "the notebook's run lengths changed"
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(NOTEBOOK.parent)}})
  client.execute()  # Raises CellExecutionError, with the cell's traceback, on any error.
  outputs = _outputs(nb)
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) >= 2, "expected the reward/accuracy plot and the staleness histogram"
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert re.search(r"^sample \d+: \S+= -> .* \| (correct|wrong)$", text, re.M), text[-2000:]
  assert "held-out after RL:" in text
  assert re.search(r"^LoRA trained versions 0 -> 2$", text, re.M), text[-2000:]
  # The notebook's own reward function scored every sample in the reward workers.
  assert re.search(r"^inline reward: [1-9]\d* calls, 0 errors, 0 timeouts$", text, re.M), text


# The real-model notebook's run lengths, and the test's: two steps of two questions x four
# samples, four held-out questions evaluated before and after, two shown.
REAL_MODEL_SHORTER = {
    "c.num_steps = 8": "c.num_steps = 2\nc.batch_groups = 2\nc.generation.group_size = 4\n"
                       "c.hf_model_dir = TWO_BLOCKS",
    "num_prompts=100, every_steps=4": "num_prompts=4, every_steps=2",
    "c.checkpoint.every_steps = 8": "c.checkpoint.every_steps = 2",
    "task.heldout(6)": "task.heldout(2)"}


def test_real_model_notebook_runs(smollm2_two_blocks):
  nb = nbformat.read(REAL_MODEL, as_version=4)
  assert sorted(_shortened(nb, REAL_MODEL_SHORTER)) == sorted(REAL_MODEL_SHORTER), (
      "the notebook's run lengths changed")
  nb.cells.insert(0, nbformat.v4.new_code_cell(f"TWO_BLOCKS = {smollm2_two_blocks[1]!r}"))
  client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                   resources={"metadata": {"path": str(NOTEBOOKS)}})
  client.execute()
  outputs = _outputs(nb)
  assert any("image/png" in o.get("data", {}) for o in outputs), "expected the learning curve"
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "<|im_start|>user\nWhat is " in text and "<|im_start|>assistant\n" in text
  for when in ("before", "after"):
    assert re.search(rf"^held-out {when} RL: strict [01]\.\d{{3}}, lenient [01]\.\d{{3}}$",
                     text, re.M), text[-3000:]
  assert len(re.findall(r"^What is \d+ [-+*] \d+\? -> .* \| (correct|wrong)$", text, re.M)) == 4
