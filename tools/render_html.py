"""Render every notebook to read-only HTML, with the outputs stored in it, without running it.

    python tools/render_html.py              # site/NAME.html per notebook, and site/index.html
    python tools/render_html.py -o /tmp/wb   # somewhere else

What you read is what the notebooks hold: the outputs of their last run on the project's CPU
machine (gloo, one process per rank), figures included. Nothing is executed and nothing is
downloaded; it takes about 15 s on a busy 2-core machine and needs only nbconvert (installed
with JupyterLab).

Widgets (the per-rank progress bars, the experiment controls) are live only in a running
notebook. The HTML shows a line in their place saying so: the notebooks store no widget state,
any that is stored is dropped (rendering it would load the widget library from a CDN when the
page is opened). The line is the one mgtutor stored as the widget's text form; a widget shown
with ipywidgets' own (its Python repr, such as "VBox(children=(HBox(children=(IntProgress(...")
gets a line saying what kind of widget it was.
"""

from __future__ import annotations

import argparse
import html
import sys
import warnings
from pathlib import Path

import nbformat
from nbconvert import HTMLExporter

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"

# Without IPython installed (nbconvert alone is enough here), code is highlighted as Python 3.
warnings.filterwarnings("ignore", message="IPython3 lexer unavailable")


def title_of(nb: nbformat.NotebookNode, fallback: str) -> str:
    """The notebook's first Markdown heading, without its #s."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return fallback


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def without_widgets(nb: nbformat.NotebookNode) -> int:
    """Replace every widget output by its line of text; return how many."""
    nb.metadata.pop("widgets", None)
    count = 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if WIDGET_VIEW not in data:
                continue
            text = str(data.get("text/plain", ""))
            if not text.startswith("["):  # ipywidgets' own repr, not the line mgtutor stores
                kind = "per-rank progress bars" if "IntProgress" in text else "interactive controls"
                text = f"[{kind}: live when the notebook runs in JupyterLab]"
            output["data"] = {"text/plain": text}
            count += 1
    return count


def render(out_dir: Path) -> list[tuple[str, str]]:
    """Write out_dir/NAME.html for every notebook; return (file name, title) pairs in order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter(template_name="lab")
    pages = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        without_widgets(nb)
        title = title_of(nb, path.stem)
        body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": title}})
        name = f"{path.stem}.html"
        (out_dir / name).write_text(body, encoding="utf-8")
        pages.append((name, title))
        print(f"{out_dir / name}  ({title})")
    return pages


def write_index(out_dir: Path, pages: list[tuple[str, str]]) -> Path:
    items = "\n".join(
        f'    <li><a href="{html.escape(name)}">{html.escape(title)}</a></li>'
        for name, title in pages
    )
    index = out_dir / "index.html"
    index.write_text(
        f"""<!DOCTYPE html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>mgtutor: multi-GPU training in PyTorch, hands-on</title>
  <style>
    body {{ font-family: system-ui, sans-serif; max-width: 46em; margin: 2em auto;
            padding: 0 1em; line-height: 1.5; }}
    li {{ margin: 0.3em 0; }}
  </style>
</head>
<body>
  <h1>mgtutor: multi-GPU training in PyTorch, hands-on</h1>
  <p>The workbook's notebooks, in order, as read-only pages. Each shows the outputs stored in
  the notebook: its last run on a machine without a GPU (every rank a CPU process, gloo).
  Nothing was executed to make these pages. The progress bars and controls are live only in
  a running notebook, so a line stands in their place here: run the notebooks in JupyterLab
  to see them (the README says how).</p>
  <ol>
{items}
  </ol>
</body>
</html>
""",
        encoding="utf-8",
    )
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "-o", "--output-dir", type=Path, default=REPO / "site", help="default: site/"
    )
    args = parser.parse_args(argv)
    pages = render(args.output_dir)
    if not pages:
        print(f"no notebooks found in {NOTEBOOKS}", file=sys.stderr)
        return 1
    print(write_index(args.output_dir, pages))
    return 0


if __name__ == "__main__":
    sys.exit(main())
