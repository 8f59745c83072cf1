"""notebooks/quickstart.ipynb runs headless from top to bottom (about two minutes on CPU),
with a reward function defined in one of its cells.

Needs the `notebook` extra (nbclient, nbformat, ipykernel, matplotlib); skipped without it.
"""

import re
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient", reason="needs nbclient (the notebook extra)")
nbformat = pytest.importorskip("nbformat", reason="needs nbformat (the notebook extra)")
pytest.importorskip("ipykernel", reason="needs ipykernel (the notebook extra)")
pytest.importorskip("matplotlib", reason="needs matplotlib (the notebook extra)")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def _outputs(nb):
  return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]


def test_notebook_is_saved_without_outputs():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  assert not _outputs(nb), "clear the notebook's outputs before saving it"


def test_quickstart_notebook_runs():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(NOTEBOOK.parent)}})
  client.execute()  # Raises CellExecutionError, with the cell's traceback, on any error.
  outputs = _outputs(nb)
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) >= 2, "expected the reward/accuracy plot and the staleness histogram"
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert re.search(r"^sample \d+: \S+= -> .* \| (correct|wrong)$", text, re.M), text[-2000:]
  assert "held-out after RL:" in text
  # The notebook's own reward function scored every sample in the reward workers.
  assert re.search(r"^inline reward: [1-9]\d* calls, 0 errors, 0 timeouts$", text, re.M), text
