"""BENCHMARKS.md stays one current table per benchmark: under its size limit, each
section with the command that reproduces it, and every section the docs name there."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
LIMIT_BYTES = 40_000
# Where the docs name a section: `BENCHMARKS.md, "Memory"`, `BENCHMARKS.md ("The quick
# start")`, `[BENCHMARKS.md](BENCHMARKS.md) ("...")`, or a link to its anchor.
_NAMED = re.compile(r'BENCHMARKS\.md\)?,?\s*\(?"([^"]+)"')
_ANCHOR = re.compile(r"BENCHMARKS\.md#([\w-]+)")


def _sections():
  """{heading: body} of the `## ` sections."""
  parts = re.split(r"^## (.+)$", (ROOT / "BENCHMARKS.md").read_text(), flags=re.M)
  return dict(zip(parts[1::2], parts[2::2]))


def _anchor(heading):
  """The anchor GitHub gives a heading."""
  return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_benchmarks_md_stays_under_its_size_limit():
  size = len((ROOT / "BENCHMARKS.md").read_bytes())
  assert size <= LIMIT_BYTES, (
      f"BENCHMARKS.md is {size:,} bytes, over {LIMIT_BYTES:,}: keep one current table per "
      "benchmark and cut prose; earlier results live in git history")


def test_every_section_names_the_command_that_reproduces_it():
  sections = _sections()
  assert sections
  blocks = {h: re.findall(r"^```\n(.*?)^```", body, flags=re.M | re.S)
            for h, body in sections.items()}
  missing = [h for h, found in blocks.items() if not any("python" in b for b in found)]
  assert not missing, f"sections of BENCHMARKS.md without a command: {missing}"


def test_the_sections_the_docs_name_exist():
  headings = list(_sections())
  texts = {p: p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                                      *(ROOT / "async_rl").rglob("*.py")]}
  named = [(p, m) for p, text in texts.items() for m in _NAMED.findall(text)]
  anchors = [(p, m) for p, text in texts.items() for m in _ANCHOR.findall(text)]
  assert named and anchors
  broken = [f"{p.relative_to(ROOT)}: {m!r}" for p, m in named
            if not any(h.startswith(m) for h in headings)]
  broken += [f"{p.relative_to(ROOT)}: #{m}" for p, m in anchors
             if m not in {_anchor(h) for h in headings}]
  assert not broken, f"names of no BENCHMARKS.md section: {broken}"
