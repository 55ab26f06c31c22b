"""The workbook in a real browser: JupyterLab, headless Chromium, Run > Run All Cells.

nbval (the notebooks' own tests) runs every cell in a kernel but never renders anything. This test
does what a learner does: it starts JupyterLab, opens a notebook in Chromium, reads what the
stored outputs show before anything runs (a line of text for each widget, never a raw
``VBox(children=...`` repr), clears the outputs, runs all cells from the Run menu, and then reads
the page:

- every code cell ran (has an execution count) and the saved notebook has no error output
  (stderr streams are expected: warnings, a child's traceback that a cell shows on purpose);
- the per-rank progress bars (mgtutor.progress: ipywidgets IntProgress, "rank 0", "rank 1", ...)
  rendered and reached 100%, and no widget failed to render;
- every matplotlib figure (image/png output) is an image the browser decoded and laid out;
- %%ddp shows each rank's output once: as tagged lines, or in its tabs with ``--tabs``.

A second test runs a notebook with one launch that fails and reads the first line of the error
the learner sees: it must be the diagnosis or the message, not a frame of mgtutor's code.

A third runs notebook 17's planner widget (its imports, draw_layout and widget cells only),
picks a ZeRO stage and types a number of layers in the page as a learner does, and checks that
the figure shown is, byte for byte, the PNG draw_layout gives for the values the controls show,
and that no redraw leaves the figure's area empty (the page would flicker). Opened before it
runs, the widget's place shows the first drawing stored with it.

A fourth needs no JupyterLab: it renders the read-only site (tools/render_html.py) and opens
every page from disk with the network closed (every request that is not a file aborted, and
none may be attempted): math drawn as MathML with no raw TeX left, every image decoded, the
planner widget's place showing its first drawing, and the index's titles with code as code.

Screenshots go to results/browser/. With MGTUTOR_UPDATE_SCREENSHOT=1, 00_setup runs too and the
screenshot of its progress bars and plot is copied to docs/workbook.png, the README's picture; a
plain run never changes a tracked file.

Hermetic: JupyterLab runs on a free port of 127.0.0.1 with a random token and its own temporary
config, data, runtime and IPython directories, on copies of the notebooks in a temporary directory
(JupyterLab saves and autosaves; the repository's notebooks are never touched). JupyterLab, its
kernels and their workers are stopped at the end, also when the test fails.

Needs Chromium and Playwright for Python; nothing downloads a browser:
    apt-get install -y chromium       # Debian/Ubuntu; or set MGTUTOR_CHROMIUM=/path/to/chrome
    pip install playwright            # never `playwright install`: the system browser is used
Without them the test skips and says so. Run it alone: python -m pytest tests/test_browser.py
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
RESULTS = REPO / "results" / "browser"
README_SCREENSHOT = REPO / "docs" / "workbook.png"

CHROMIUM = os.environ.get("MGTUTOR_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
VIEWPORT = {"width": 1280, "height": 1200}  # tall enough for 00_setup's bars and a plot
SERVER_START_S = 90  # JupyterLab answering /api/status
PAGE_LOAD_S = 90  # the notebook rendered and its kernel idle
RUN_ALL_S = 300  # Run All Cells, per notebook (measured 25-150 s on 2 shared cores)

# The notebook run here: per-rank progress bars, a figure and %%ddp's per-rank tabs, in about a
# third of the time 00_setup took (55-80 s, which ran here until the test command outgrew its
# budget). One is enough to see that they render; every notebook's cells run under nbval, and
# the controls of 02, 04 and 05 are tested in tests/test_interactive.py.
BROWSER_NOTEBOOKS = ["11_live_ranks.ipynb"]
UPDATE_SCREENSHOT = os.environ.get("MGTUTOR_UPDATE_SCREENSHOT") == "1"
if UPDATE_SCREENSHOT:
    BROWSER_NOTEBOOKS.append("00_setup.ipynb")  # the README's picture

# What ipywidgets' own text form of mgtutor's widgets starts with: shown wherever a widget
# cannot be drawn (a notebook opened before it runs is not trusted, so its widgets are not).
RAW_WIDGET_REPRS = ("VBox(", "HBox(", "Tab(", "IntProgress(", "Output()")

pytestmark = pytest.mark.timeout(600)


def _browser_or_skip():
    """Playwright's sync API, or skip the test saying how to install what is missing."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip(
            "browser test needs Playwright for Python: pip install playwright "
            "(the browser itself comes from the system: apt-get install -y chromium; "
            "never `playwright install`)"
        )
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(
            f"browser test needs Chromium at {CHROMIUM}: apt-get install -y chromium "
            "(or set MGTUTOR_CHROMIUM to a Chrome/Chromium executable)"
        )
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        pytest.skip("browser test needs JupyterLab: pip install -r requirements.txt")
    return sync_playwright


# --- JupyterLab as a subprocess ------------------------------------------------------------


@dataclass
class Lab:
    url: str  # http://127.0.0.1:PORT
    token: str
    root: Path  # the temporary copy of notebooks/ JupyterLab serves
    log: Path

    def api(self, path: str, method: str = "GET") -> object:
        request = urllib.request.Request(
            f"{self.url}{path}",
            method=method,
            headers={"Authorization": f"token {self.token}"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def page_url(self, notebook: str) -> str:
        # One workspace per notebook: a workspace restores the tabs opened before in it.
        workspace = Path(notebook).stem.replace("_", "-")
        return f"{self.url}/lab/workspaces/{workspace}/tree/{notebook}?token={self.token}"

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _lab_dirs(base: Path) -> dict[str, str]:
    """Own Jupyter and IPython directories, with settings that keep first-run popups away."""
    dirs = {name: base / name for name in ("config", "data", "runtime", "ipython")}
    for path in dirs.values():
        path.mkdir(parents=True)
    # news_url None: JupyterLab fetches no news feed; no update check; no extension manager
    # asking PyPI. A null cannot be given on the command line, hence the file.
    (dirs["config"] / "jupyter_server_config.json").write_text(
        json.dumps(
            {
                "LabApp": {
                    "news_url": None,
                    "check_for_updates_class": "jupyterlab.NeverCheckForUpdate",
                    "extension_manager": "readonly",
                },
            }
        )
    )
    # The "Would you like to get notified about official Jupyter news?" toast is asked while
    # fetchNews is "none" (the default); "false" is the learner's answer "No".
    settings = dirs["config"] / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    # Each cell's start and end go into its metadata: the test reports the slowest cells.
    notebook_settings = settings.parent / "notebook-extension"
    notebook_settings.mkdir()
    (notebook_settings / "tracker.jupyterlab-settings").write_text(
        json.dumps({"recordTiming": True})
    )
    return {
        "JUPYTER_CONFIG_DIR": str(dirs["config"]),
        "JUPYTER_DATA_DIR": str(dirs["data"]),
        "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
        "IPYTHONDIR": str(dirs["ipython"]),
    }


def _copy_notebooks(dest: Path) -> None:
    dest.mkdir()
    for notebook in NOTEBOOKS.glob("*.ipynb"):
        shutil.copy2(notebook, dest / notebook.name)
    if (NOTEBOOKS / "scripts").is_dir():
        shutil.copytree(
            NOTEBOOKS / "scripts", dest / "scripts", ignore=shutil.ignore_patterns("__pycache__")
        )


def _stop_lab(proc: subprocess.Popen, lab: Lab) -> None:
    """Stop JupyterLab, its kernels and whatever they started; never leave a process behind."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)  # kernels and their workers
    except psutil.Error:
        family = []
    with contextlib.suppress(Exception):  # kernels first, politely: they stop their workers
        for session in lab.api("/api/sessions"):  # type: ignore[union-attr]
            lab.api(f"/api/sessions/{session['id']}", method="DELETE")
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)  # the server's own process group
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)
    # Kernels run in process groups of their own; anything of the family still here goes now.
    for member in family:
        with contextlib.suppress(psutil.Error):
            member.kill()
    psutil.wait_procs(family, timeout=5)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    _browser_or_skip()
    base = tmp_path_factory.mktemp("browser")
    root = base / "notebooks"
    _copy_notebooks(root)
    token = secrets.token_hex(16)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", "MPLBACKEND")}
    env.update(_lab_dirs(base / "jupyter"))
    # The kernel imports this checkout's mgtutor, whichever checkout the venv was installed from.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable, "-m", "jupyter", "lab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",  # the port chosen, or fail: never a silent other one
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--allow-root",  # CI containers run as root; harmless otherwise
    ]  # fmt: skip
    log = base / "jupyterlab.log"
    lab = Lab(url=f"http://127.0.0.1:{port}", token=token, root=root, log=log)
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            cmd, cwd=root, env=env, stdout=log_file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited with {proc.returncode}:\n{lab.log_tail()}")
            try:
                lab.api("/api/status")
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer in {SERVER_START_S} s:\n"
                                f"{lab.log_tail()}")  # fmt: skip
                time.sleep(0.5)
        yield lab
    finally:
        _stop_lab(proc, lab)
        if RESULTS.is_dir():
            shutil.copy2(log, RESULTS / "jupyterlab.log")


@pytest.fixture(scope="module")
def chromium():
    sync_playwright = _browser_or_skip()
    RESULTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def browser(lab: Lab, chromium):
    """Chromium, with JupyterLab started for it."""
    return chromium


# --- reading the page -----------------------------------------------------------------------

# Everything is read inside the notebook panel on show, so another tab can never answer.
_PANEL = "document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)')"

STATE_JS = f"""() => {{
  const panel = {_PANEL};
  if (!panel) return null;
  const indicator = panel.querySelector('.jp-Notebook-ExecutionIndicator');
  const status = Array.from(document.querySelectorAll('.jp-StatusBar-TextItem'))
                      .map(e => e.textContent.trim()).find(t => t.includes(' | ')) || '';
  return {{
    kernel: indicator ? indicator.dataset.status : null,
    status: status,
    prompts: Array.from(panel.querySelectorAll('.jp-CodeCell .jp-InputPrompt'))
                  .map(e => e.textContent.trim()),
  }};
}}"""

# mgtutor.progress draws, per rank, an HBox [IntProgress(description="rank N"), Label("... (P%)")]
# ipywidgets 8 renders IntProgress as .widget-hprogress > label.widget-label + .progress >
# .progress-bar, whose style width is (value - min) / (max - min) as a percentage.
# %%ddp's tabs: the label of each tab, and the text of the tab shown (rank 0's at first).
TABS_JS = f"""() => {{
  const panel = {_PANEL};
  return Array.from(panel.querySelectorAll('.widget-tab, .jupyter-widget-tab')).map(tab => ({{
    labels: Array.from(tab.querySelectorAll('.lm-TabBar-tabLabel')).map(e => e.textContent),
    shown: Array.from(tab.querySelectorAll('.widget-output, .jupyter-widget-output'))
                .filter(e => e.offsetParent !== null).map(e => e.textContent).join(' '),
  }}));
}}"""

PROGRESS_JS = f"""() => {{
  const panel = {_PANEL};
  return Array.from(panel.querySelectorAll('.widget-hprogress, .widget-progress')).map(bar => {{
    const description = bar.querySelector('.widget-label');
    const fill = bar.querySelector('.progress-bar');
    const label = Array.from(bar.parentElement.children)
                       .find(e => e !== bar && e.classList.contains('widget-label'));
    return {{
      description: description ? description.textContent.trim() : '',
      width: fill ? fill.style.width : '',
      style: fill ? fill.className : '',
      label: label ? label.textContent.trim() : '',
    }};
  }});
}}"""

# Every image/png output (cell outputs and those inside Output widgets), scrolled into view so
# the browser lays it out, with its decoded and its drawn size.
IMAGES_JS = f"""async () => {{
  const panel = {_PANEL};
  const images = Array.from(panel.querySelectorAll(
      '.jp-OutputArea-output[data-mime-type="image/png"] img'));
  const out = [];
  for (const img of images) {{
    img.scrollIntoView({{block: 'center'}});
    await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
    if (!img.complete || img.naturalWidth === 0) {{ try {{ await img.decode(); }} catch (e) {{}} }}
    const box = img.getBoundingClientRect();
    out.push({{natural: [img.naturalWidth, img.naturalHeight], drawn: [box.width, box.height]}});
  }}
  return out;
}}"""

# The notebook is ready for Run All when all its cells are in the page and the status bar says
# its kernel is idle ("Python 3 (ipykernel) | Idle"). The toolbar's execution indicator alone
# also says idle while the page still shows "No Kernel | Initializing".
READY_JS = f"""(cells) => {{
  const panel = {_PANEL};
  if (!panel || panel.querySelectorAll('.jp-Notebook .jp-Cell').length !== cells) return false;
  const kernel = Array.from(document.querySelectorAll('.jp-StatusBar-TextItem'))
                      .map(e => e.textContent.trim()).find(t => t.includes(' | '));
  return !!kernel && !kernel.startsWith('No Kernel') && kernel.endsWith('| Idle');
}}"""

SAVED_MESSAGE_GONE_JS = """() => !Array.from(document.querySelectorAll('.jp-StatusBar-TextItem'))
    .some(e => e.textContent.includes('Saving'))"""

# The text of every cell output, as the page shows it (an Output widget's own output areas are
# part of the cell output that holds the widget, not counted again).
OUTPUT_TEXTS_JS = f"""() => Array.from({_PANEL}.querySelectorAll('.jp-OutputArea-output'))
    .filter(e => !e.parentElement.closest('.jupyter-widgets'))
    .map(e => e.textContent)"""

# The first line of a code cell's last output (where its error is drawn), as the page shows it.
LAST_OUTPUT_FIRST_LINE_JS = f"""(index) => {{
  const cell = {_PANEL}.querySelectorAll('.jp-CodeCell')[index];
  const outputs = cell ? cell.querySelectorAll('.jp-OutputArea-output') : [];
  if (!outputs.length) return null;
  const last = outputs[outputs.length - 1];
  return (last.innerText || last.textContent).split('\\n').map(l => l.trim()).find(Boolean) || '';
}}"""

WIDGET_TROUBLE_JS = f"""() => {{
  const text = {_PANEL}.textContent;
  return ['Error displaying widget', 'Loading widget...', 'Failed to display']
    .filter(s => text.includes(s));
}}"""

# Scroll the notebook so the first progress bars are near the top, under the last lines of the
# cell that launched them, and say whether they and the next figure are both in view.
SCROLL_TO_BARS_JS = f"""async () => {{
  const panel = {_PANEL};
  const bar = panel.querySelector('.widget-hprogress');
  if (!bar) return null;
  const frame = () => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const scroller = bar.closest('.jp-WindowedPanel-outer');
  const wrapper = bar.closest('.jp-Cell-outputWrapper');
  wrapper.scrollIntoView({{block: 'start'}});
  // Cells off screen are laid out lazily (content-visibility), so the page can shift while
  // scrolling: aim again until it holds still.
  for (let i = 0; scroller && i < 20; i++) {{
    await frame();
    const delta = wrapper.getBoundingClientRect().top - scroller.getBoundingClientRect().top - 60;
    if (Math.abs(delta) < 2) break;
    scroller.scrollTop += delta;
  }}
  await frame();
  const cell = bar.closest('.jp-Cell');
  const cells = Array.from(panel.querySelectorAll('.jp-Cell'));
  const plot = cells.slice(cells.indexOf(cell))
      .map(c => c.querySelector('.jp-OutputArea-output[data-mime-type="image/png"] img'))
      .find(Boolean);
  const view = (scroller || panel).getBoundingClientRect();
  return {{
    bars: bar.getBoundingClientRect().top >= view.top,
    plot: !!plot && plot.getBoundingClientRect().bottom <= view.bottom,
  }};
}}"""


def _menu(page, menu: str, command: str) -> None:
    """Click a main-menu entry, as a learner does: e.g. Run > Run All Cells.

    An entry is greyed out while the notebook is still being set up; then close the menu and
    look again.
    """
    item = f".lm-Menu li.lm-Menu-item[data-command='{command}']"
    deadline = time.monotonic() + 30
    while True:
        page.click(f".lm-MenuBar-itemLabel:text-is('{menu}')")
        page.wait_for_selector(item, timeout=10_000)
        if page.query_selector(f"{item}:not(.lm-mod-disabled)"):
            page.click(item)
            return
        page.keyboard.press("Escape")
        if time.monotonic() > deadline:
            pytest.fail(f"menu entry {menu} > {command} stayed disabled for 30 s")
        time.sleep(0.5)


def _dismiss_popups(page) -> None:
    """Close any notification toast (none is expected with the settings above) and dialog."""
    for close in page.query_selector_all(".jp-Notification-Toast-Close, .Toastify__close-button"):
        with contextlib.suppress(Exception):
            close.click(timeout=2000)
    if page.query_selector(".jp-Dialog"):
        page.keyboard.press("Escape")


def _open(page, lab: Lab, notebook: str) -> None:
    """Open ``notebook`` and wait for its cells and an idle kernel; fold the file browser away."""
    cells = len(json.loads((lab.root / notebook).read_text())["cells"])
    page.goto(lab.page_url(notebook))
    page.wait_for_function(READY_JS, arg=cells, timeout=PAGE_LOAD_S * 1000, polling=250)
    _dismiss_popups(page)
    # Fold the left sidebar (the file browser) away, as a click on its tab does: the notebook
    # gets the width, the screenshots show more of it.
    for tab in page.query_selector_all(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current"):
        tab.click()


def _raw_reprs(texts: list[str]) -> list[str]:
    return [text[:120] for text in texts if any(r in text for r in RAW_WIDGET_REPRS)]


def _wait_run_all(page) -> dict:
    """Wait until Run All has finished: something ran, nothing is queued, the kernel is idle."""
    deadline = time.monotonic() + RUN_ALL_S
    started, settled, state = False, 0, None
    while time.monotonic() < deadline:
        state = page.evaluate(STATE_JS)
        running = any("*" in p for p in state["prompts"])
        started = started or running or any(p[1:-2].isdigit() for p in state["prompts"])
        if state["kernel"] in ("dead", "unknown") or any(
            word in state["status"] for word in ("Dead", "Restarting", "Unknown")
        ):
            pytest.fail(f"the kernel died while running all cells: {state}")
        idle = state["kernel"] == "idle" and state["status"].endswith("| Idle")
        settled = settled + 1 if started and not running and idle else 0
        if settled >= 3:  # idle three polls in a row: not a gap between two cells
            return state
        time.sleep(0.5)
    pytest.fail(f"Run All Cells did not finish in {RUN_ALL_S} s; last state {state}")


def _save_and_read(page, path: Path) -> dict:
    """File > Save Notebook, then the notebook as saved: outputs with their types."""
    before = path.stat().st_mtime_ns
    _menu(page, "File", "docmanager:save")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if path.stat().st_mtime_ns != before and not page.query_selector(".jp-mod-dirty"):
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(path.read_text())
        time.sleep(0.3)
    pytest.fail(f"{path.name} was not saved within 30 s")


def _slowest(code_cells: list[dict], n: int = 3) -> str:
    """The n slowest cells by the timing JupyterLab recorded in their metadata."""
    times = []
    for i, cell in enumerate(code_cells):
        execution = cell.get("metadata", {}).get("execution", {})
        start, end = execution.get("iopub.execute_input"), execution.get("shell.execute_reply")
        if start and end:
            seconds = (_timestamp(end) - _timestamp(start)).total_seconds()
            times.append((seconds, i))
    return ", ".join(f"code cell {i} {s:.1f} s" for s, i in sorted(times, reverse=True)[:n])


def _timestamp(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


# --- the test -------------------------------------------------------------------------------


@pytest.mark.parametrize("notebook", BROWSER_NOTEBOOKS)
def test_notebook_runs_in_jupyterlab(lab: Lab, browser, notebook: str) -> None:
    stem = Path(notebook).stem
    for old in RESULTS.glob(f"{stem}-*.png"):
        old.unlink()
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    console_errors: list[str] = []
    page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
    try:
        _open(page, lab, notebook)
        page.screenshot(path=str(RESULTS / f"{stem}-1-opened.png"))

        # 0. Opened before any cell runs, the stored outputs read as text: each widget shows
        # the line mgtutor stored for it, not ipywidgets' repr.
        stored = page.evaluate(OUTPUT_TEXTS_JS)
        assert stored, f"{notebook} shows no stored outputs"
        assert not _raw_reprs(stored), f"raw widget reprs in {notebook}: {_raw_reprs(stored)}"
        assert any(t.startswith("[progress bars of ranks") for t in stored), stored

        # Clear the stored outputs, so that everything checked below comes from this run.
        _menu(page, "Edit", "editmenu:clear-all")
        page.wait_for_function(
            f"() => !{_PANEL}.querySelector('.jp-OutputArea-output')", timeout=10_000
        )
        started = time.monotonic()
        _menu(page, "Run", "runmenu:run-all")
        state = _wait_run_all(page)
        run_s = time.monotonic() - started
        print(f"{notebook}: Run All Cells took {run_s:.1f} s in the browser")
        _dismiss_popups(page)

        # 1. Every cell ran, and none raised. A failing cell stops Run All: the cells after it
        # keep an empty prompt. The saved copy tells errors from stderr, which the page does not.
        saved = _save_and_read(page, lab.root / notebook)
        code_cells = [c for c in saved["cells"] if c["cell_type"] == "code"]
        errors = [
            f"cell {i} ({''.join(c['source']).splitlines()[0][:60]!r}): "
            f"{o.get('ename')}: {o.get('evalue')}"
            for i, c in enumerate(saved["cells"])
            for o in c.get("outputs", [])
            if o["output_type"] == "error"
        ]
        assert not errors, f"error outputs in {notebook}:\n" + "\n".join(errors)
        not_run = [i for i, c in enumerate(code_cells) if c.get("execution_count") is None]
        assert not not_run, f"code cells {not_run} of {notebook} did not run; prompts {state}"
        assert all(p[1:-2].isdigit() for p in state["prompts"]), state
        trouble = page.evaluate(WIDGET_TROUBLE_JS)
        assert not trouble, f"widgets did not render in {notebook}: {trouble}"

        # 2. The per-rank progress bars rendered and reached 100%.
        bars = [b for b in page.evaluate(PROGRESS_JS) if b["description"].startswith("rank ")]
        assert {"rank 0", "rank 1"} <= {b["description"] for b in bars}, (
            f"no per-rank progress bars rendered in {notebook}: {bars}"
        )
        unfinished = [b for b in bars if b["width"] != "100%" or "(100%)" not in b["label"]]
        assert not unfinished, f"progress bars short of 100% in {notebook}: {unfinished}"
        assert all("progress-bar-success" in b["style"] for b in bars), bars
        in_view = page.evaluate(SCROLL_TO_BARS_JS)
        with contextlib.suppress(Exception):  # the status bar's "Saving completed" fades out
            page.wait_for_function(SAVED_MESSAGE_GONE_JS, timeout=5000)
        page.wait_for_timeout(300)
        page.screenshot(path=str(RESULTS / f"{stem}-2-progress.png"))

        # 3. %%ddp shows each rank's output once: tagged lines by default, with --tabs in a
        # tab per rank and not as lines too.
        sources = "".join("".join(c["source"]) for c in code_cells)
        if "%%ddp\n" in sources:
            page_text = " ".join(page.evaluate(OUTPUT_TEXTS_JS))
            assert page_text.count("before: [1.0, 1.0]") == 1, page_text.count("before: [1.0")
            assert "[rank 0] before: [1.0, 1.0]" in page_text
        if "%%ddp --tabs\n" in sources:
            tabs = page.evaluate(TABS_JS)
            assert any({"rank 0", "rank 1"} <= set(t["labels"]) for t in tabs), tabs
            assert any("rank 0 holds [3.0, 3.0]" in t["shown"] for t in tabs), tabs
            page_text = " ".join(page.evaluate(OUTPUT_TEXTS_JS))
            assert page_text.count("rank 0 holds [3.0, 3.0]") == 1, page_text
            assert "[rank 0] rank 0 holds" not in page_text, page_text

        # 4. Every figure is visible: decoded (natural size) and laid out (drawn size).
        images = page.evaluate(IMAGES_JS)
        pngs_saved = sum(
            "image/png" in o.get("data", {}) for c in code_cells for o in c.get("outputs", [])
        )
        assert images, f"no image/png output rendered in {notebook}"
        assert len(images) >= pngs_saved, (len(images), pngs_saved)
        blank = [i for i in images if min(i["natural"]) <= 0 or min(i["drawn"]) <= 0]
        assert not blank, f"figures not visible in {notebook}: {blank}"
        for n, output in enumerate(
            page.query_selector_all(
                ".jp-NotebookPanel:not(.lm-mod-hidden) "
                ".jp-OutputArea-output[data-mime-type='image/png']"
            ),
            start=1,
        ):
            output.screenshot(path=str(RESULTS / f"{stem}-3-plot{n}.png"))
        page.screenshot(path=str(RESULTS / f"{stem}-4-end.png"))
        print(f"{notebook}: {len(code_cells)} cells ran, {len(bars)} rank bars at 100%, "
              f"{len(images)} figures visible; slowest cells: {_slowest(code_cells)}")  # fmt: skip

        if stem == "00_setup" and UPDATE_SCREENSHOT:
            assert in_view == {"bars": True, "plot": True}, f"screenshot would miss: {in_view}"
            README_SCREENSHOT.parent.mkdir(exist_ok=True)
            shutil.copy2(RESULTS / f"{stem}-2-progress.png", README_SCREENSHOT)
    except BaseException:
        with contextlib.suppress(Exception):
            page.screenshot(path=str(RESULTS / f"{stem}-failed.png"))
        if console_errors:
            print(f"browser console errors ({len(console_errors)}):", *console_errors[-10:],
                  sep="\n  ")  # fmt: skip
        print("JupyterLab log (tail):", lab.log_tail(), sep="\n")
        raise
    finally:
        context.close()


FAILING_LAUNCH = [
    "import mgtutor",
    "def work():\n"
    "    import torch.distributed as dist\n"
    "    mgtutor.setup()\n"
    "    if dist.get_rank() == 1:\n"
    "        raise ValueError('a bad batch on rank 1')\n"
    "    dist.barrier()",
    "mgtutor.launch(work, world_size=2)",
    "print('not reached: Run All stops at the error')",
]


def test_an_error_cells_first_line_is_the_message(lab: Lab, browser) -> None:
    # A learner reads an error from its top: the first line must say what went wrong (the
    # doctor's diagnosis or the exception's message), not a separator or mgtutor's frames.
    import nbformat

    notebook = "failing_launch.ipynb"
    cells = [nbformat.v4.new_code_cell(source) for source in FAILING_LAUNCH]
    kernel = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb = nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": kernel})
    nbformat.write(nb, lab.root / notebook)
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    try:
        _open(page, lab, notebook)
        _menu(page, "Run", "runmenu:run-all")
        _wait_run_all(page)
        saved = _save_and_read(page, lab.root / notebook)
        errors = [o for c in saved["cells"] for o in c.get("outputs", [])
                  if o["output_type"] == "error"]  # fmt: skip
        assert [e["ename"] for e in errors] == ["WorkerError"], errors
        assert "not reached" not in json.dumps(saved["cells"][3].get("outputs", []))
        first_line = page.evaluate(LAST_OUTPUT_FIRST_LINE_JS, 2)  # the launch cell's error
        page.screenshot(path=str(RESULTS / "failing_launch.png"))
        assert "rank 1 raised ValueError" in first_line, (
            f"the error's first line is {first_line!r}, not the message"
        )
    except BaseException:
        with contextlib.suppress(Exception):
            page.screenshot(path=str(RESULTS / "failing_launch-failed.png"))
        print("JupyterLab log (tail):", lab.log_tail(), sep="\n")
        raise
    finally:
        context.close()


# --- notebook 17's planner widget -------------------------------------------------------------

PLANNER_NOTEBOOK = "17_planning_layouts.ipynb"
# Each control of the planner by the description the page shows, and draw_layout's argument.
PLANNER_ARGUMENTS = {
    "layers": "layers", "hidden": "hidden", "seq_len": "seq_len", "GPUs": "gpus",
    "GB per GPU": "gpu_memory_gb", "tp": "tp", "pp": "pp", "ZeRO stage": "zero",
}  # fmt: skip
REDRAW_S = 30  # a change in the page to its new figure (measured 0.2-0.7 s)

# The figure in the planner's Output widget (its data: URL) and the value each control shows.
PLANNER_JS = f"""() => {{
  const panel = {_PANEL};
  const img = panel.querySelector('.jupyter-widget-output img, .widget-output img');
  const values = {{}};
  for (const control of panel.querySelectorAll('.widget-dropdown, .widget-slider')) {{
    const field = control.querySelector('select, .widget-readout');
    values[control.querySelector('.widget-label').textContent.trim()] =
        field.tagName === 'SELECT' ? field.value : field.textContent.trim();
  }}
  return {{src: img ? img.src : null, values: values}};
}}"""

# Count the moments a redraw leaves the figure's area with no figure (the page would flicker).
WATCH_EMPTY_FIGURE_JS = f"""() => {{
  const area = {_PANEL}.querySelector('.jupyter-widget-output, .widget-output');
  window.mgtutorEmptyFigure = 0;
  new MutationObserver(() => {{ if (!area.querySelector('img')) window.mgtutorEmptyFigure++; }})
      .observe(area, {{childList: true, subtree: true}});
}}"""

# Images drawn from the stored outputs, outside any widget (a notebook opened before it runs).
STORED_IMAGES_JS = f"""() => Array.from({_PANEL}.querySelectorAll(
    '.jp-OutputArea-output[data-mime-type="image/png"] img'))
    .filter(e => !e.closest('.jupyter-widgets')).length"""

NEW_FIGURE_JS = f"""(old) => {{ const now = ({PLANNER_JS})().src; return !!now && now !== old; }}"""


def _planner_notebook(dest: Path) -> tuple[dict, Callable[..., tuple]]:
    """Notebook 17's first code cell, its draw_layout cell and the widget cell, in a notebook.

    Only what the widget needs: the cells before it launch ranks, which nbval runs. The widget
    cell keeps its stored output (the text line a notebook opened before it runs shows).
    Returns the defaults the draw_layout cell defines and its draw_layout.
    """
    import nbformat

    cells = nbformat.read(NOTEBOOKS / PLANNER_NOTEBOOK, as_version=4).cells
    code = [c for c in cells if c.cell_type == "code"]
    draw = next(i for i, c in enumerate(code) if "def draw_layout(" in c.source)
    widget = code[draw + 1]
    assert "display_widget(" in widget.source, "the planner's widget must follow draw_layout"
    imports, drawing = (nbformat.v4.new_code_cell(c.source) for c in (code[0], code[draw]))
    kernel = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb = nbformat.v4.new_notebook(cells=[imports, drawing, widget], metadata={"kernelspec": kernel})
    nbformat.write(nb, dest)
    # The two cells run here too, as in the kernel (asserts and prints with them): the test
    # renders with their draw_layout what each setting should show.
    namespace: dict = {}
    for cell in (imports, drawing):
        exec(cell.source, namespace)
    import matplotlib.pyplot as plt

    plt.close(namespace["fig"])
    return namespace["defaults"], namespace["draw_layout"]


def test_planner_widget_redraws_what_a_learner_picks(lab: Lab, browser) -> None:
    # Notebook 17's planner as a learner uses it: pick a ZeRO stage, type a number of layers.
    # The figure must change, and be draw_layout's for what the controls show, byte for byte.
    # ZeRO-0 with the defaults' pipeline (pp=2): a planned layout, whose figure follows the layers.
    import base64

    import matplotlib.pyplot as plt
    from IPython.core.pylabtools import print_figure

    notebook = "planner_widget.ipynb"
    defaults, draw_layout = _planner_notebook(lab.root / notebook)

    def figure_for(values: dict) -> str:
        fig, _ = draw_layout(**values)  # what the kernel's inline backend makes of the figure
        png = print_figure(fig, "png")
        plt.close(fig)
        return "data:image/png;base64," + base64.b64encode(png).decode()

    def shown() -> tuple[str | None, dict]:
        state = page.evaluate(PLANNER_JS)
        values = {PLANNER_ARGUMENTS[k]: int(v) for k, v in state["values"].items()}
        return state["src"], values

    def wait_for_new_figure(old: str | None, change: str) -> None:
        try:
            page.wait_for_function(NEW_FIGURE_JS, arg=old, timeout=REDRAW_S * 1000)
        except Exception as exc:  # Playwright's TimeoutError
            pytest.fail(f"the planner's figure did not change in {REDRAW_S} s after {change}: "
                        f"{type(exc).__name__}")  # fmt: skip

    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    try:
        _open(page, lab, notebook)
        # Opened before it runs, the widget's place shows the first drawing stored with it
        # (mgtutor's display_widget), not a line of text or ipywidgets' repr.
        stored = page.evaluate(OUTPUT_TEXTS_JS)
        assert not _raw_reprs(stored), _raw_reprs(stored)
        assert page.evaluate(STORED_IMAGES_JS) == 1, stored
        _menu(page, "Run", "runmenu:run-all")
        _wait_run_all(page)
        saved = _save_and_read(page, lab.root / notebook)
        errors = [f"cell {i} ({''.join(c['source'])[:40]!r}): {o['ename']}: {o['evalue']}"
                  for i, c in enumerate(saved["cells"]) for o in c.get("outputs", [])
                  if o["output_type"] == "error"]  # fmt: skip
        assert not errors, "error outputs in the planner's cells:\n" + "\n".join(errors)
        assert not page.evaluate(WIDGET_TROUBLE_JS)
        wait_for_new_figure(None, "running the cells")
        src, values = shown()
        assert values == defaults, values
        first_is_right = src == figure_for(values)  # no diff of two base64 strings on failure
        assert first_is_right, "the first figure is not draw_layout's for the defaults"

        page.evaluate(WATCH_EMPTY_FIGURE_JS)
        page.locator(".widget-dropdown", has_text="ZeRO stage").locator("select").select_option("0")
        wait_for_new_figure(src, "picking ZeRO stage 0")
        src, _ = shown()
        readout = page.locator(".widget-slider", has_text="layers").locator(".widget-readout")
        readout.click()
        page.keyboard.press("Control+A")
        page.keyboard.type("64")
        page.keyboard.press("Enter")
        wait_for_new_figure(src, "typing 64 layers")
        src, values = shown()
        page.locator(".jupyter-widget-output, .widget-output").scroll_into_view_if_needed()
        page.screenshot(path=str(RESULTS / "planner-widget.png"))
        assert values == {**defaults, "zero": 0, "layers": 64}, values
        figure_is_right = src == figure_for(values)
        assert figure_is_right, f"the figure shown is not draw_layout(**{values})'s"
        assert page.evaluate("() => window.mgtutorEmptyFigure") == 0, (
            "a redraw left the figure's area empty for a moment (the page flickers)"
        )
    except BaseException:
        with contextlib.suppress(Exception):
            page.screenshot(path=str(RESULTS / "planner-widget-failed.png"))
        print("JupyterLab log (tail):", lab.log_tail(), sep="\n")
        raise
    finally:
        context.close()


# --- the read-only site, offline ---------------------------------------------------------------

# What each page of the site shows, read in the page: math drawn as MathML (and any TeX left as
# text), images decoded, the planner widget's place, the title.
SITE_PAGE_JS = """async () => {
  const prose = Array.from(document.querySelectorAll('.jp-RenderedMarkdown'));
  const maths = prose.flatMap(p => Array.from(p.querySelectorAll('math')));
  const leftover = prose.map(p => {
    const copy = p.cloneNode(true);
    copy.querySelectorAll('code, pre, math').forEach(e => e.remove());
    return copy.textContent;
  }).join(' ');
  const images = Array.from(document.images);
  for (const img of images) {
    if (!img.complete || img.naturalWidth === 0) { try { await img.decode(); } catch (e) {} }
  }
  const widgetCell = Array.from(document.querySelectorAll('.jp-CodeCell'))
      .find(c => (c.querySelector('.jp-InputArea') || c).textContent.includes('display_widget('));
  const widgetImages = widgetCell
      ? Array.from(widgetCell.querySelectorAll('.jp-OutputArea-output img')) : [];
  return {
    title: document.title,
    maths: maths.length,
    mathml: maths.filter(m => m instanceof MathMLElement
                         && m.getBoundingClientRect().width > 0).length,
    dollars: (leftover.match(/\\$/g) || []).length,
    images: images.length,
    undecoded: images.filter(i => i.naturalWidth === 0).length,
    widget: widgetCell ? widgetCell.querySelector('.jp-OutputArea').textContent.trim() : null,
    widgetImages: widgetImages.filter(i => i.naturalWidth > 0).length,
  };
}"""

INDEX_JS = """() => Array.from(document.querySelectorAll('li')).map(li => ({
  text: li.textContent, code: Array.from(li.querySelectorAll('code')).map(c => c.textContent),
}))"""


def _render_html_module():
    import importlib.util

    pytest.importorskip("nbconvert")
    pytest.importorskip(
        "latex2mathml", reason="the site's math needs latex2mathml: pip install -r requirements.txt"
    )
    spec = importlib.util.spec_from_file_location("render_html", REPO / "tools" / "render_html.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _has_tex(notebook: Path) -> bool:
    """Whether a notebook's Markdown holds math: a $ outside code blocks and code spans."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    prose = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    prose = re.sub(r"```.*?```", "", prose, flags=re.DOTALL)
    return "$" in re.sub(r"`[^`]*`", "", prose)


def test_the_read_only_site_reads_offline(chromium, tmp_path: Path) -> None:
    # tools/render_html.py's pages, opened from disk with every request that is not a file
    # closed: none may be attempted, the math must be drawn (MathML, no raw TeX), every figure
    # decoded, the planner widget's place must show its first drawing, and the index's titles
    # their code as code.
    render_html = _render_html_module()
    site = tmp_path / "site"
    assert render_html.main(["-o", str(site)]) == 0
    notebooks = sorted(NOTEBOOKS.glob("*.ipynb"))
    context = chromium.new_context(viewport=VIEWPORT)
    attempted: list[str] = []

    def close_the_network(route) -> None:
        attempted.append(route.request.url)
        route.abort()

    # file:// pages and their data: images never reach a route; anything else would.
    context.route(re.compile(r"^(?!file:|data:)"), close_the_network)
    context.on(
        "request",
        lambda r: None if r.url.startswith(("file:", "data:")) else attempted.append(r.url),
    )
    page = context.new_page()
    try:
        page.goto((site / "index.html").as_uri())
        titles = page.evaluate(INDEX_JS)
        assert len(titles) == len(notebooks), titles
        assert not [t["text"] for t in titles if "`" in t["text"]], titles
        assert ["mgtutor.Pool", "%%ddp"] in [t["code"] for t in titles], titles
        shown = {}
        for notebook in notebooks:
            page.goto((site / f"{notebook.stem}.html").as_uri(), wait_until="load")
            shown[notebook.stem] = state = page.evaluate(SITE_PAGE_JS)
            assert "`" not in state["title"], state
            assert state["dollars"] == 0, f"raw TeX left in {notebook.name}: {state}"
            assert state["mathml"] == state["maths"], f"math not drawn in {notebook.name}: {state}"
            assert (state["maths"] > 0) == _has_tex(notebook), f"{notebook.name}: {state}"
            assert state["undecoded"] == 0, f"images not drawn in {notebook.name}: {state}"
        planner = shown["17_planning_layouts"]
        assert planner["widgetImages"] == 1 and not planner["widget"], planner
        page.goto((site / "17_planning_layouts.html").as_uri())
        page.locator(".jp-CodeCell", has_text="display_widget(").locator(
            "img"
        ).first.scroll_into_view_if_needed()
        page.screenshot(path=str(RESULTS / "site-planner.png"), full_page=False)
        assert not attempted, f"the site asked the network for: {sorted(set(attempted))[:10]}"
        print("site offline:", {k: (v["maths"], v["images"]) for k, v in shown.items()})
    finally:
        context.close()
