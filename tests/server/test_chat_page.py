"""The chat page at `/` in a real browser: Debian's chromium, driven by Selenium through
Debian's chromedriver, against a real `ft serve` of the packaged SmolLM2-135M-Instruct with an
API key. A typed message streams an answer into the page, Stop stops it (and the server frees
the request), New chat clears it, markdown is rendered safely, and the browser console has no
errors. A screenshot is kept under the test's temporary folder (its path is printed).

`scripts/setup.sh` installs chromium and chromium-driver when it runs as root (as CI does);
elsewhere the test skips, saying what is missing.
"""

from __future__ import annotations

import shutil
import sys
import time

import httpx
import pytest
from helpers import ServeProcess, metric

pytestmark = pytest.mark.slow

KEY = "page-key"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                "(pip install -e '.[test]')")
if not (CHROMIUM and DRIVER):
    pytest.skip("needs Debian's chromium and chromium-driver (scripts/setup.sh installs them "
                "as root)", allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServeProcess("--api-key", KEY, "--max-model-len", "1024",
                     log_dir=tmp_path_factory.mktemp("serve")).wait()
    # One token first: the first request of a fresh engine pays its warm-up, which would
    # otherwise count against the page's waits.
    httpx.post(s.base + "/v1/chat/completions", timeout=600,
               headers={"Authorization": f"Bearer {KEY}"},
               json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1100,800"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(DRIVER))
    yield driver
    driver.quit()


def _set(driver, field: str, value: str) -> None:
    el = driver.find_element(By.ID, field)
    el.clear()
    el.send_keys(value)
    driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", el)


def _answer(driver):
    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def _type(driver, text: str) -> None:
    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


def test_page_streams_stops_and_has_no_console_errors(server, browser, tmp_path):
    d = browser
    d.get(server.base + "/")
    wait = WebDriverWait(d, 60)
    wait.until(lambda d: "API key" in d.find_element(By.ID, "model").text)  # 401 -> asks
    d.find_element(By.ID, "settings").is_displayed()
    _set(d, "api_key", KEY)
    wait.until(lambda d: "context" in d.find_element(By.ID, "model").text)  # /v1/models
    _set(d, "temperature", "0")
    _set(d, "max_tokens", "4")

    # 1. a typed message streams an answer, which ends by itself
    _type(d, "What is the capital of France?")
    WebDriverWait(d, 600).until(lambda d: _answer(d).get_attribute("data-finish"))
    first = _answer(d)
    assert first.get_attribute("data-finish") in ("stop", "length")
    assert first.find_element(By.CSS_SELECTOR, ".body").text.strip()
    assert d.find_element(By.CSS_SELECTOR, ".msg.user").text.endswith("capital of France?")

    # 2. Stop ends a long answer at once, and the server frees the request
    _set(d, "max_tokens", "400")
    _type(d, "Write a long story about a lighthouse keeper.")
    WebDriverWait(d, 600).until(lambda d: _answer(d).find_element(By.CSS_SELECTOR, ".body").text)
    d.find_element(By.ID, "stop").click()
    WebDriverWait(d, 10).until(lambda d: _answer(d).get_attribute("data-finish") == "stopped")
    text = _answer(d).find_element(By.CSS_SELECTOR, ".body").text
    time.sleep(1.0)
    assert _answer(d).find_element(By.CSS_SELECTOR, ".body").text == text  # nothing more came
    deadline = time.monotonic() + 30
    while metric(server.base, "freetoken_http_requests_in_flight") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(server.base, "freetoken_http_requests_in_flight") == 0
    assert d.find_element(By.ID, "send").is_enabled()

    shot = tmp_path / "chat-page.png"
    d.save_screenshot(str(shot))
    print(f"screenshot: {shot}")

    # 3. New chat clears the conversation
    d.find_element(By.ID, "new").click()
    assert not d.find_elements(By.CSS_SELECTOR, ".msg")

    errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


SCRIPTED = ("<think>\nThe user wants code.\n</think>\n\nHere is **Python**:\n\n"
            "```python\nprint('<hi>')\n```\n- one\n- two")


def test_reasoning_folded_and_markdown_streamed(browser, tmp_path):
    """The scripted engine (fake_engine.py) answers with a think block and markdown."""
    from fake_engine import FakeEngine
    from helpers import ThreadServer

    from freetoken import assets
    from freetoken.commands.serve import make_app
    from freetoken.config import EngineConfig, ServerConfig
    from freetoken.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_path(assets.smollm2_path())
    conf = ServerConfig(engine=EngineConfig(), served_model_name="fake",
                        reasoning_parser="think")
    srv = ThreadServer(make_app(conf, lambda _cfg: FakeEngine(tok)))
    try:
        d = browser
        d.get(srv.base + "/")
        d.find_element(By.ID, "toggle-settings").click()
        _set(d, "max_tokens", "64")
        WebDriverWait(d, 30).until(lambda d: "fake" in d.find_element(By.ID, "model").text)
        # set, not typed: a typed newline is Enter, which sends
        d.execute_script("document.getElementById('input').value = arguments[0]",
                         f"[[say:{SCRIPTED}:yas]]")
        d.find_element(By.ID, "send").click()
        WebDriverWait(d, 60).until(lambda d: _answer(d).get_attribute("data-finish"))
        assert _answer(d).get_attribute("data-finish") == "stop", _answer(d).text
        answer = _answer(d)
        details = answer.find_element(By.TAG_NAME, "details")
        assert details.is_displayed() and details.get_attribute("open") is None  # folded
        details.find_element(By.TAG_NAME, "summary").click()
        assert "The user wants code." in details.text
        body = answer.find_element(By.CSS_SELECTOR, ".body")
        assert body.find_element(By.TAG_NAME, "strong").text == "Python"
        code = body.find_element(By.CSS_SELECTOR, "pre code.language-python")
        assert code.text == "print('<hi>')"
        assert [li.text for li in body.find_elements(By.TAG_NAME, "li")] == ["one", "two"]
        shot = tmp_path / "chat-page-reasoning.png"
        d.save_screenshot(str(shot))
        print(f"screenshot: {shot}")
        assert not [e for e in d.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        srv.stop()


def test_markdown_is_rendered_and_escaped(server, browser):
    browser.get(server.base + "/")
    html = browser.execute_script(
        "return window.freetoken.renderMarkdown(arguments[0])",
        "# Title\n**bold** and `x<y`\n\n```python\nprint('<b>')\n```\n- a\n- b\n"
        "<img src=x onerror=alert(1)> [l](javascript:alert(1)) [ok](https://example.org)")
    assert "<h1>Title</h1>" in html and "<strong>bold</strong>" in html
    assert "<code>x&lt;y</code>" in html
    assert '<pre><code class="language-python">print(&#39;&lt;b&gt;&#39;)</code></pre>' in html
    assert "<ul><li>a</li><li>b</li></ul>" in html
    assert "<img" not in html and "&lt;img" in html
    assert 'href="javascript' not in html and 'href="https://example.org"' in html


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
