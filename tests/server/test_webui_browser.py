"""The page at / in a real browser (headless Chromium through Selenium) against live servers:
the default model (SmolLM2) for chat, streaming, stop and the status panel; a fake engine
behind --api-key for the key prompt. One server and one browser per module.

Skipped when Chromium, its driver or selenium is missing; under CI=true that fails instead.
Set VKRT_UI_SCREENSHOT=PATH to have the chat test save a screenshot of the page there
(docs/images/ui.png is made that way); normal runs write nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import missing
from tests.server.browser import (
    SCREENSHOT_ENV,
    chromium_unavailable_reason,
    start_chromium,
    wait_until,
)
from tests.server.fake_engine import FakeEngine
from tests.server.live_model import MODEL_NAME, LiveModel, live_model
from vkrt.server import ServerConfig, build_app
from vkrt.server.background import BackgroundServer

SLOW = 600  # seconds: a bound for what the model does on a slow machine, never an expectation

# Records every distinct text the last reply shows, as the page renders it (no polling).
RECORD_REPLY = """
window.seenReplies = [];
new MutationObserver(() => {
  const content = document.querySelector('#messages .msg.assistant:last-child .content');
  const text = content ? content.textContent : '';
  if (text && window.seenReplies.at(-1) !== text) window.seenReplies.push(text);
}).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    reason = chromium_unavailable_reason()
    if reason is not None:
        missing("Chromium", reason)
    driver = start_chromium()
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def live(browser: Any, smollm2_path: Path) -> Iterator[LiveModel]:
    with live_model(smollm2_path, max_model_len=1024, max_num_seqs=4) as server:
        yield server


def scrape(url: str, key: str | None = None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(f"{url}/metrics", headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def text(driver: Any, element_id: str) -> str:
    return str(driver.find_element("id", element_id).text)


def set_field(driver: Any, element_id: str, value: str) -> None:
    field = driver.find_element("id", element_id)
    field.clear()
    field.send_keys(value)


def send(driver: Any, message: str) -> None:
    set_field(driver, "prompt", message)
    driver.find_element("id", "send").click()


def last_reply(driver: Any) -> str:
    replies = driver.find_elements("css selector", "#messages .msg.assistant .content")
    return str(replies[-1].text) if replies else ""


def idle(driver: Any) -> bool:
    return driver.find_element("id", "chat").get_attribute("data-state") == "idle"


def test_chat_streams_the_reply_and_the_status_panel_moves(browser: Any, live: LiveModel) -> None:
    browser.get(f"{live.url}/")
    wait_until(browser, lambda d: MODEL_NAME in [o.text for o in d.find_elements("css selector", "#model option")],
               60, "the model picker to list the served model")
    wait_until(browser, lambda d: text(d, "st-running") == "0", 60, "the status panel's first reading")
    device = next(dict(labels)["device"] for (name, labels) in scrape(live.url) if name == "vkrt_device_info")
    assert device in text(browser, "st-device")
    assert text(browser, "st-tokens") == "0" and text(browser, "st-ttft-p50") == "–"
    assert "reserved" in text(browser, "st-memory")

    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "24")
    browser.execute_script(RECORD_REPLY)
    question = "What is the capital of France?"
    send(browser, question)
    wait_until(browser, lambda d: idle(d) and d.find_elements("css selector", "#messages .msg.assistant .copy"),
               SLOW, "the reply to finish")
    final = last_reply(browser)
    seen = browser.execute_script("return window.seenReplies")
    partial = [s for s in seen if s != final]
    assert final and len(partial) >= 2, f"expected the reply to arrive in pieces, saw {seen!r}"
    assert all(final.startswith(s) for s in partial), seen

    # The panel shows what /metrics says once the request is done.
    metrics = scrape(live.url)
    generated = int(metrics[("vkrt_engine_generation_tokens_total", ())])
    assert generated > 0
    wait_until(browser, lambda d: text(d, "st-tokens") == str(generated) and text(d, "st-requests") == "1",
               60, f"the panel to show {generated} tokens and 1 request")
    wait_until(browser, lambda d: float(d.find_element("id", "rate-chart").get_attribute("data-max")) > 0,
               60, "the tokens/s chart to show the request")
    assert text(browser, "st-ttft-p50") != "–" and text(browser, "st-itl-p99") != "–"

    # The same request through the API, greedy: the page sent what its settings say.
    reply = httpx.post(f"{live.url}/v1/chat/completions", timeout=SLOW, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": question}], "temperature": 0,
        "max_tokens": 24})
    assert reply.status_code == 200, reply.text
    assert final == reply.json()["choices"][0]["message"]["content"].strip()

    stored = browser.execute_script("return JSON.parse(localStorage.getItem('vkrt.conversations'))")
    assert [m["role"] for m in stored[0]["messages"]] == ["user", "assistant"]
    assert stored[0]["messages"][0]["content"] == question

    if os.environ.get(SCREENSHOT_ENV):
        wait_until(browser, lambda d: int(d.find_element("id", "rate-chart").get_attribute("data-samples")) >= 3,
                   60, "a few chart samples")
        browser.save_screenshot(os.environ[SCREENSHOT_ENV])


def test_stop_aborts_the_generation_on_the_server(browser: Any, live: LiveModel) -> None:
    before = scrape(live.url)
    aborted = before[("vkrt_requests_total", (("finish_reason", "abort"),))]
    browser.find_element("id", "new-chat").click()
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "900")
    send(browser, "Write a very long story about a dragon who learns to fly, in many chapters.")
    wait_until(browser, lambda d: last_reply(d) != "", SLOW, "the story to start")
    assert not idle(browser)
    browser.find_element("id", "stop").click()
    wait_until(browser, idle, 60, "the page to stop streaming")
    assert browser.find_elements("css selector", "#messages .msg.assistant .stopped")
    wait_until(browser, lambda d: scrape(live.url)[("vkrt_num_requests_running", ())] == 0, 60,
               "the server's running count to return to 0")
    after = scrape(live.url)
    assert after[("vkrt_requests_total", (("finish_reason", "abort"),))] == aborted + 1
    wait_until(browser, lambda d: text(d, "st-running") == "0", 60, "the panel's running count to return to 0")


@pytest.fixture(scope="module")
def keyed(browser: Any) -> Iterator[str]:
    config = ServerConfig(served_model_name="fake", api_key="sk-page-test")
    with BackgroundServer(build_app(FakeEngine(step_delay=0.01), config)) as server:
        yield server.url


def test_the_page_asks_for_the_api_key_and_sends_it(browser: Any, keyed: str) -> None:
    assert httpx.get(f"{keyed}/metrics", timeout=10).status_code == 401
    browser.get(f"{keyed}/")  # the page itself needs no key
    dialog = browser.find_element("id", "key-dialog")
    wait_until(browser, lambda d: dialog.get_attribute("open") is not None, 30, "the key prompt")
    assert browser.find_elements("css selector", "#model option") == []

    set_field(browser, "key-input", "wrong")
    browser.find_element("id", "key-save").click()
    wait_until(browser, lambda d: d.find_element("id", "key-error").is_displayed(), 30, "the refused-key message")
    assert dialog.get_attribute("open") is not None

    set_field(browser, "key-input", "sk-page-test")
    browser.find_element("id", "key-save").click()
    wait_until(browser, lambda d: "fake" in [o.text for o in d.find_elements("css selector", "#model option")],
               30, "the model list, fetched with the key")
    assert dialog.get_attribute("open") is None
    wait_until(browser, lambda d: text(d, "st-running") == "0", 30, "/metrics, read with the key")
    set_field(browser, "max-tokens", "5")
    send(browser, "hi")
    wait_until(browser, lambda d: idle(d) and last_reply(d) == "abcde", 30, "the fake engine's reply")


STORED = [{"id": "1", "title": "formats", "messages": [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": '{"city":"Paris","temp":[1,2]}', "reasoning": "The user wants JSON.",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
]}]


def test_stored_conversations_render_reasoning_tool_calls_and_json(browser: Any, keyed: str) -> None:
    """A conversation kept in localStorage comes back on reload: reasoning folded apart from the
    answer, a JSON answer and the tool call's arguments as formatted blocks."""
    import json

    browser.get(f"{keyed}/")
    browser.execute_script("localStorage.setItem('vkrt.conversations', arguments[0])", json.dumps(STORED))
    browser.refresh()
    reply = wait_until(browser, lambda d: d.find_elements("css selector", "#messages .msg.assistant"), 30,
                       "the stored reply")[0]
    reasoning = reply.find_element("css selector", "details.reasoning")
    assert reasoning.get_attribute("open") is None  # folded
    assert reasoning.find_element("tag name", "pre").get_attribute("textContent") == "The user wants JSON."
    answer = reply.find_element("css selector", ".content pre.json").get_attribute("textContent")
    assert answer == json.dumps({"city": "Paris", "temp": [1, 2]}, indent=2)
    call = reply.find_element("css selector", ".tool-call")
    assert call.find_element("css selector", ".tool-name").text == "tool call: get_weather"
    assert call.find_element("css selector", "pre.json").get_attribute("textContent") == '{\n  "city": "Paris"\n}'
    assert reply.find_elements("css selector", "button.copy")
