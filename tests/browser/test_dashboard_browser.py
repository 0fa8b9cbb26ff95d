"""The live loss page in a real headless browser: Debian's chromium driven by playwright.

A real (tiny) proxy run provides the records; the page must draw one loss vertex per history record,
follow the file as it grows, switch to log scale, and fetch nothing but the dashboard server.
Needs `.ci/browser-deps.sh` (apt chromium + pip playwright); skips only when no chromium binary exists.
The screenshot goes to tests/browser/artifacts/ (or $ANDREA_TEST_ARTIFACTS) and its path is printed.
"""
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from andrea.pipeline.dashboard import DashboardServer
from andrea.util.atomic import atomic_write_json
from andrea.run.proxy import supervise
from andrea.run.proxy import journal
from test_proxy import write_run

CHROMIUM = os.environ.get("ANDREA_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(os.environ.get("ANDREA_TEST_ARTIFACTS", Path(__file__).resolve().parent / "artifacts"))

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).is_file(),
                                reason=f"no chromium binary at {CHROMIUM}; .ci/browser-deps.sh installs it")


def wait_js(page, expr: str, what: str, timeout: float = 20.0):
    """Poll a JS expression from Python: the page's CSP forbids the eval that wait_for_function uses."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if page.evaluate(expr):
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; page state: "
                         f"{page.evaluate('JSON.stringify(window.ANDREA)')}")


def sync_playwright():
    try:
        from playwright.sync_api import sync_playwright as sp
    except ImportError:
        pytest.fail("playwright is not installed; run .ci/browser-deps.sh (pip install playwright)")
    return sp()


def screenshot(page, name: str, what: str):
    """The whole page as ARTIFACTS/<name>.png, its path printed; a blank page fails."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"{what} screenshot: {shot}")
    assert shot.stat().st_size > 10_000


def vertices(d: str) -> int:
    return d.count("M") + d.count("L")


def test_dashboard_draws_and_follows_a_run(tiny_run):
    cfg, tmp = tiny_run
    cfg["train"].update(steps=20, eval_every=5, ckpt_every=10,
                        phases=[{"name": "pretrain", "start_step": 0}, {"name": "polish", "start_step": 14}])
    c, run = write_run(cfg, tmp)
    assert supervise(c, run, flush_s=0, progress=False) == 0
    # a second run folder, overlaid: another experiment's records, 7 steps, still running
    other = tmp / "other"
    other.mkdir()
    atomic_write_json(other / "other.loss.json", {"exp": "other", "history": [
        {"step": i, "phase": "pretrain", "loss": 4.5 - 0.1 * i, "lr": 1e-3, "tokens_per_s": 900.0} for i in range(1, 8)]})
    atomic_write_json(other / "other.state.json", {"exp": "other", "status": "running", "step": 7, "total_steps": 50})
    srv = DashboardServer([run, other], "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            requests, errors = [], []
            page.on("request", lambda r: requests.append(r.url))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(srv.url)
            wait_js(page, "window.ANDREA.runs.t && window.ANDREA.runs.t.points === 20", "20 points")
            train = page.locator('#loss-chart path.train[data-run="t"]')
            assert train.get_attribute("data-points") == "20" and train.get_attribute("data-drawn") == "20"
            assert vertices(train.get_attribute("d")) == 20
            val = page.locator('#loss-chart path.val[data-run="t"]')
            assert val.get_attribute("data-points") == "4"  # steps 5, 10, 15, 20
            assert page.locator('#runs tr[data-run="t"]').get_attribute("data-status") == "finished"
            assert page.locator("#loss-chart line.pivot").count() == 1  # pretrain -> polish
            wait_js(page, "window.ANDREA.runs.other && window.ANDREA.runs.other.points === 7", "the second run")
            assert page.locator('#loss-chart path.train[data-run="other"]').get_attribute("data-points") == "7"
            assert page.locator('#lr-chart path.lr[data-run="other"]').get_attribute("data-points") == "7"
            assert page.locator('#runs tr[data-run="other"]').get_attribute("data-status") == "running"
            assert page.locator("#loss-chart path.train").count() == 2

            # the history grows as the proxy grows it (whole lines appended to the journal): the page follows
            rec = json.loads((run / "t.loss.json").read_text())
            last = {k: v for k, v in rec["history"][-1].items() if k != "val_loss"}
            with open(run / "t.loss.jsonl", "ab") as f:
                f.write(b"".join(journal.encode({**last, "step": last["step"] + i, "loss": last["loss"] * (1 - 0.01 * i)})
                                 for i in range(1, 6)))
            wait_js(page, "window.ANDREA.runs.t.points === 25", "25 points after the file grew")
            assert train.get_attribute("data-points") == "25"
            assert vertices(train.get_attribute("d")) == 25 and val.get_attribute("data-points") == "4"

            linear = train.get_attribute("d")
            page.check("#logscale")
            assert train.get_attribute("d") != linear and vertices(train.get_attribute("d")) == 25

            screenshot(page, "dashboard", "dashboard")
            browser.close()
        assert errors == []
        assert requests and all(u.startswith(srv.url) for u in requests), requests
    finally:
        srv.shutdown()
        srv.server_close()


def test_dashboard_follows_a_live_proxy_run(tiny_run):
    """A proxy process trains while the page polls: the curve grows, then shows the stop."""
    from test_proxy import finish, running_proxy, state_step, wait_for

    cfg, tmp = tiny_run
    cfg["train"].update(steps=100000, ckpt_every=0)
    _, run = write_run(cfg, tmp)
    srv = DashboardServer([run], "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    with running_proxy(run) as proc:
        wait_for(lambda: state_step(run) >= 3, "step 3", proc=proc)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(srv.url)
            wait_js(page, "(window.ANDREA.runs.t || {}).points >= 3", "the first points")
            first = page.evaluate("window.ANDREA.runs.t.points")
            wait_js(page, f"window.ANDREA.runs.t.points > {first}", "the curve to grow")
            assert page.locator('#runs tr[data-run="t"]').get_attribute("data-status") == "running"
            proc.send_signal(signal.SIGTERM)
            rc, err = finish(proc)
            assert rc == 0, err
            n = len(json.loads((run / "t.loss.json").read_text())["history"])
            wait_js(page, f"window.ANDREA.runs.t.status === 'stopped' && window.ANDREA.runs.t.points === {n}",
                    "the stopped state and the final history")
            path = page.locator('#loss-chart path.train[data-run="t"]')
            assert path.get_attribute("data-points") == str(n) and vertices(path.get_attribute("d")) == n
            browser.close()
        srv.shutdown()
        srv.server_close()
