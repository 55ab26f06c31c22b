"""Render every notebook to read-only HTML, with the outputs stored in it, without running it.

    python tools/render_html.py              # site/NAME.html per notebook, and site/index.html
    python tools/render_html.py -o /tmp/wb   # somewhere else

What you read is what the notebooks hold: the outputs of their last run on the project's CPU
machine (gloo, one process per rank), figures included. Nothing is executed and nothing is
downloaded, neither here nor when a page is opened: the pages load no script, style or font
from the network, so they read the same offline. It takes about 15 s on a 2-core machine with
nothing else running (2026-11-30) and needs nbconvert (installed with JupyterLab) and
latex2mathml (requirements.txt).

Math is turned into MathML here, which the browser draws itself (nbconvert's pages would load
MathJax from a CDN and show raw TeX without it). Widgets (the per-rank progress bars, the
experiment controls, the planner) are live only in a running notebook, and no widget state is
stored or rendered (that would load the widget library from a CDN). In a widget's place the
page shows the first drawing the widget held when it was shown, where mgtutor stored one
(mgtutor.launcher.progress_bars.display_widget: the planner's), else the line mgtutor stored as the
widget's text form; a widget shown with ipywidgets' own text form (its Python repr, such as
"VBox(children=(HBox(children=(IntProgress(...") gets a line saying what kind of widget it was.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
import warnings
from pathlib import Path

import nbformat
from jinja2 import DictLoader, pass_context
from nbconvert import HTMLExporter
from nbconvert.filters.markdown_mistune import IPythonRenderer, MarkdownWithMath

try:
    from latex2mathml.converter import convert as tex_to_mathml
except ImportError:  # said when rendering, so that `--help` and the title helpers still work
    tex_to_mathml = None

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"

# Without IPython installed (nbconvert alone is enough here), code is highlighted as Python 3.
warnings.filterwarnings("ignore", message="IPython3 lexer unavailable")


def title_of(nb: nbformat.NotebookNode, fallback: str) -> str:
    """The notebook's first Markdown heading, without its #s (Markdown's backticks kept)."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return fallback


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def without_widgets(nb: nbformat.NotebookNode) -> int:
    """Replace every widget output by its stored drawing or its line of text; return how many."""
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
            if "image/png" in data:  # the widget's first drawing (display_widget stores it)
                output["data"]["image/png"] = data["image/png"]
            count += 1
    return count


class _MathMLRenderer(IPythonRenderer):
    """nbconvert's Markdown renderer, with TeX turned into MathML instead of left for MathJax."""

    def block_math(self, body: str) -> str:
        return _mathml(body, "block")

    def inline_math(self, body: str) -> str:
        return _mathml(body, "inline")

    def latex_environment(self, name: str, body: str) -> str:
        return _mathml(f"\\begin{{{name}}}{body}\\end{{{name}}}", "block")


def _trusted(html: str) -> str:
    """The workbook's own HTML, as it is (see OfflineHTMLExporter.default_filters)."""
    return html


def _mathml(tex: str, display: str) -> str:
    try:
        return tex_to_mathml(tex, display=display)
    except Exception as exc:  # latex2mathml's own errors name no notebook: the TeX does
        raise ValueError(f"cannot turn this TeX into MathML: {tex!r} ({exc})") from exc


# nbconvert's "lab" page without the scripts it loads from a CDN: require.js (for widgets, not
# rendered here), MathJax (math is MathML already) and mermaid (no notebook draws a diagram).
_OFFLINE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block extra_css -%}<style>math { font-size: 1.1em; }</style>{%- endblock extra_css -%}
"""


class OfflineHTMLExporter(HTMLExporter):
    """nbconvert's HTML in JupyterLab's style, math as MathML, nothing loaded from a network."""

    def __init__(self, **kwargs) -> None:
        loader = DictLoader({"offline.html.j2": _OFFLINE_TEMPLATE})
        super().__init__(
            template_name="lab", template_file="offline.html.j2", extra_loaders=[loader], **kwargs
        )

    def default_filters(self):
        # nbconvert's lab template (7.17) runs every code cell's highlighted source through
        # clean_html (bleach), which took half of this tool's time and changed no byte of any
        # page (2026-11-30: all 23 files identical with and without it). The pages are the
        # workbook's own notebooks, whose Markdown and HTML outputs nbconvert already trusts
        # (its sanitize_html is off by default): the last filter of a name wins.
        yield from super().default_filters()
        yield "clean_html", _trusted

    @pass_context
    def markdown2html(self, context, source: str) -> str:
        cell = context.get("cell", {})
        renderer = _MathMLRenderer(
            escape=False,
            attachments=cell.get("attachments", {}),
            embed_images=self.embed_images,
            path=context.get("resources", {}).get("metadata", {}).get("path", ""),
            anchor_link_text=self.anchor_link_text,
            exclude_anchor_links=self.exclude_anchor_links,
            **self.lexer_options,
        )
        return MarkdownWithMath(renderer=renderer).render(source)


def title_html(title: str) -> str:
    """A title's Markdown code spans (`launch`) as <code>, the rest escaped."""
    parts = re.split(r"`([^`]+)`", title)  # text, code, text, code, ..., text
    return "".join(
        f"<code>{html.escape(part)}</code>" if i % 2 else html.escape(part)
        for i, part in enumerate(parts)
    )


def render(out_dir: Path) -> list[tuple[str, str]]:
    """Write out_dir/NAME.html for every notebook; return (file name, title) pairs in order."""
    if tex_to_mathml is None:
        raise SystemExit("render_html needs latex2mathml for the math: pip install latex2mathml")
    out_dir.mkdir(parents=True, exist_ok=True)
    exporter = OfflineHTMLExporter()
    pages = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        without_widgets(nb)
        title = title_of(nb, path.stem)
        page_title = title.replace("`", "")  # a browser tab shows text only
        body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": page_title}})
        name = f"{path.stem}.html"
        (out_dir / name).write_text(body, encoding="utf-8")
        pages.append((name, title))
        print(f"{out_dir / name}  ({title})")
    return pages


def write_index(out_dir: Path, pages: list[tuple[str, str]]) -> Path:
    items = "\n".join(
        f'    <li><a href="{html.escape(name)}">{title_html(title)}</a></li>'
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
    code {{ font-size: 0.95em; background: #f2f2f2; padding: 0 0.2em; border-radius: 3px; }}
  </style>
</head>
<body>
  <h1>mgtutor: multi-GPU training in PyTorch, hands-on</h1>
  <p>The workbook's notebooks, in order, as read-only pages. Each shows the outputs stored in
  the notebook: its last run on a machine without a GPU (every rank a CPU process, gloo).
  Nothing was executed to make these pages, and they load nothing from the network. The
  progress bars and controls are live only in a running notebook, so their first drawing or a
  line stands in their place here: run the notebooks in JupyterLab to use them (the README
  says how).</p>
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
