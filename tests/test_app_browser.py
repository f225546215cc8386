"""The dashboard in a real browser: ``workbench app`` on loopback, every page in headless Chromium.

Each page does its main action the way a user would; the test checks that a plotly chart rendered and
that no exception or error is on the page, and saves a screenshot (to docs/screenshots/, those of
docs/dashboard.md, when WORKBENCH_SCREENSHOTS=docs/screenshots is set).
Skipped unless the ``playwright`` package and a system Chromium are installed (no browser download).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser
sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).is_file():
    pytest.skip("no system Chromium (apt-get install chromium)", allow_module_level=True)

# Screenshots go to a scratch folder; WORKBENCH_SCREENSHOTS=docs/screenshots refreshes docs/dashboard.md's.
SCREENSHOTS = Path(os.environ.get("WORKBENCH_SCREENSHOTS") or Path(tempfile.gettempdir()) / "workbench-screenshots")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
WAIT_MS = 600_000  # one page's work on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``workbench app`` on a free loopback port; its whole process group is killed afterwards."""
    port = free_port()
    log = tmp_path_factory.mktemp("app") / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "workbench.cli", "app", "--port", str(port)],
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                    if response.read() == b"ok":
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the app did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()


def settle(page) -> None:
    """Wait until the script run that the last action started has finished (Streamlit marks its state)."""
    app = '[data-testid="stApp"][data-test-script-state="{}"]'
    try:
        page.wait_for_selector(app.format("running"), timeout=3000)
    except sync_api.TimeoutError:
        pass  # the run was over before we looked
    page.wait_for_selector(app.format("notRunning"), timeout=WAIT_MS)


def screenshot(page, name: str) -> None:
    """The whole page, from the top, into SCREENSHOTS/NAME.png."""
    height = min(max(page.evaluate('() => document.querySelector(\'[data-testid="stMain"]\').scrollHeight'), 900), 2400)
    page.set_viewport_size({"width": 1440, "height": height})
    page.evaluate('() => document.querySelector(\'[data-testid="stMain"]\').scrollTo(0, 0)')
    page.mouse.move(1435, height - 5)  # an empty corner: no hover labels or chart toolbars in the picture
    page.wait_for_timeout(1000)  # plotly re-lays out to the new size
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"))


def click(page, label: str) -> None:
    page.get_by_role("button", name=label, exact=True).click()
    settle(page)


def choose(page, option: str) -> None:
    page.get_by_text(option, exact=True).click()
    settle(page)


def open_page(page, title: str) -> None:
    """Through the sidebar, so the session (and what other pages computed) carries over."""
    page.get_by_test_id("stSidebarNav").get_by_text(title, exact=True).click()
    settle(page)


# (url to open, then steps as (action, argument), screenshot name); the default page runs the default prompt.
PAGES = [
    ("", [], "run_lens"),
    ("attention", [], "attention"),
    ("interventions", [(click, "Generate both")], "interventions"),
    ("patching", [(click, "Run sweep")], "patching"),
    ("probes", [(click, "Run depth sweep")], "probes"),
    ("kv-cache", [(click, "Clear layer"), (click, "Continue")], "kv_cache"),
    ("interventions", [(open_page, "Artifacts"), (click, "Keep for replay and comparison"),
                       (choose, "The Interventions page's edited run"), (click, "Keep for replay and comparison"),
                       (click, "Replay")], "artifacts"),
]


@pytest.mark.parametrize("path, steps, name", PAGES, ids=[p[2] for p in PAGES])
def test_page_renders_in_chromium(server, browser, path, steps, name):
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    try:
        page.goto(f"{server}/{path}", timeout=WAIT_MS)
        settle(page)
        for action, argument in steps:
            action(page, argument)
        page.wait_for_selector('[data-testid="stPlotlyChart"] .main-svg', timeout=WAIT_MS)
        if not path:  # the default prompt's logit lens is a drawn heatmap
            assert page.locator('[data-testid="stPlotlyChart"] g.hm').count() >= 1
        if name == "artifacts":  # the kept clean trace replays bit for bit
            assert "Verdict: identical" in page.get_by_test_id("stAlertContentSuccess").inner_text()
        assert page.locator('[data-testid="stException"]').count() == 0
        errors = page.locator('[data-testid="stAlertContentError"]')
        assert errors.count() == 0, errors.all_inner_texts()
        screenshot(page, name)
    finally:
        page.close()
