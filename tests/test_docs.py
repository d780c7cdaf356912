"""The README stays a short guide (at most 200 lines) and every relative link in it and in docs/ (guide/ and results/ too) resolves."""
import pathlib
import re

ROOT = pathlib.Path(__file__).parents[1]


def test_readme_is_at_most_200_lines():
  assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_relative_links_resolve():
  broken = []
  for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
    text = page.read_text()
    for target, anchor in re.findall(r"\]\(([^)#\s]+)(#[^)\s]*)?\)", text):
      if re.match(r"[a-z]+://", target):
        continue
      path = page.parent / target
      if not path.exists():
        broken.append(f"{page.name}: {target}")
      elif anchor and path.suffix == ".md":
        headings = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
                    for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}
        if anchor[1:] not in headings:
          broken.append(f"{page.name}: {target}{anchor}")
  assert not broken, broken


def test_integrate_quotes_the_example_it_runs_whole():
  """docs/guide/integrate.md shows examples/gpipe_loop.py as it is (the notebook runs that file), so the page cannot drift."""
  blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "guide" / "integrate.md").read_text(), re.S)
  assert (ROOT / "examples" / "gpipe_loop.py").read_text() in blocks
