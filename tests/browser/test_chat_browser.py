"""The chat page of `andrea serve` in a real headless browser: Debian's chromium driven by playwright.

`andrea serve` runs as a process on a model trained here (tests/trained_model.py); the page must
show the answer growing as its events arrive, keep the conversation (the second question is sent
with the first exchange), and fetch nothing but the server. Needs `.ci/browser-deps.sh` (apt
chromium + pip playwright); skips only when no chromium binary exists. The screenshot goes to
tests/browser/artifacts/ (or $ANDREA_TEST_ARTIFACTS) and its path is printed.
"""
import json

import test_dashboard_browser as dashboard
from test_dashboard_browser import ARGS, CHROMIUM, screenshot, sync_playwright, wait_js
from test_serve import serving
from trained_model import make_run

pytestmark = dashboard.pytestmark  # skipped only where there is no chromium binary

# Every text the answer's bubble is given, in order (each update replaces its text node).
RECORD = """() => {
  window.SHOWN = [];
  new MutationObserver((records) => {
    for (const r of records)
      for (const n of r.addedNodes)
        if (n.nodeType === 3 && n.parentElement.classList.contains("assistant")) window.SHOWN.push(n.data);
  }).observe(document.getElementById("log"), { childList: true, subtree: true });
}"""


def answer_text(page) -> str:
    return page.evaluate("document.querySelector('.msg.assistant:last-of-type').firstChild.data")


def test_chat_page_streams_the_answer_and_keeps_the_conversation(tmp_path):
    run = make_run(tmp_path)
    with serving(run, "--slots", "2") as s:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1000, "height": 700})
            requests, errors = [], []
            page.on("request", lambda r: requests.append(r))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(s.url)
            wait_js(page, "window.ANDREA_CHAT.model === 'mini'", "the model's name from /v1/models")
            page.fill("#temperature", "0")
            page.evaluate(RECORD)

            page.fill("#question", "hi")
            page.press("#question", "Enter")
            wait_js(page, "window.ANDREA_CHAT.answers === 1", "the first answer")
            shown = page.evaluate("window.SHOWN")
            assert shown[-1] == "hello there" and answer_text(page) == "hello there"
            # streamed: the bubble grew through the answer's prefixes, token by token
            assert len(shown) >= 5 and all("hello there".startswith(t) for t in shown), shown
            assert [len(t) for t in shown] == sorted(len(t) for t in shown)

            page.fill("#question", "Name a colour")
            page.click("#send")
            wait_js(page, "window.ANDREA_CHAT.answers === 2", "the second answer")
            assert answer_text(page) == "blue é"
            assert page.evaluate("window.ANDREA_CHAT.messages") == [
                {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
                {"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "blue é"}]
            asks = [json.loads(r.post_data) for r in requests if r.url.endswith("/v1/chat/completions")]
            assert [len(a["messages"]) for a in asks] == [1, 3] and all(a["stream"] and a["temperature"] == 0
                                                                         for a in asks)
            assert page.locator(".msg.user").count() == 2 and page.locator(".msg.error").count() == 0

            screenshot(page, "chat", "chat page")
            browser.close()
    assert errors == []
    assert requests and all(r.url.startswith(s.url) for r in requests), [r.url for r in requests]
