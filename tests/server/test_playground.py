"""The playground page in a real browser: headless Chromium (the system's package) driven by
Selenium, against a real server on the loopback address."""

from __future__ import annotations

import shutil

import openai
import pytest

from etinfer.server.playground import STATIC
from tests.server.conftest import API_KEY, COMPLETIONS, GREEDY_PROMPT, HTTP, post

webdriver = pytest.importorskip("selenium.webdriver", reason="needs the test extra (selenium)")
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support import expected_conditions  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
PAGE_WAIT_S = 120


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("no Chromium here: install the system's chromium and chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 "--window-size=1200,1000"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(CHROMEDRIVER))
    yield driver
    driver.quit()


def open_page(browser, server, **fields: str) -> None:
    browser.get(f"{server.url}/")
    key = browser.find_element(By.ID, "api-key")
    key.send_keys(API_KEY)
    browser.find_element(By.CSS_SELECTOR, "input[name=mode][value=completion]").click()
    prompt = browser.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys(GREEDY_PROMPT)
    for name, value in fields.items():
        field = browser.find_element(By.ID, name)
        field.clear()
        field.send_keys(value)


def send_and_wait(browser) -> None:
    browser.find_element(By.ID, "send").click()
    WebDriverWait(browser, PAGE_WAIT_S).until(
        lambda b: (
            b.find_element(By.ID, "summary").text or b.find_element(By.ID, "error").is_displayed()
        )
    )


def test_the_page_holds_no_absolute_url_and_is_served_at_the_root(server):
    for path in STATIC.iterdir():
        text = path.read_text()
        assert "http://" not in text and "https://" not in text, path.name
    page = HTTP.get(f"{server.url}/")  # no key needed: only /v1 is guarded
    assert page.status_code == 200 and "etinfer playground" in page.text
    assert HTTP.get(f"{server.url}/static/playground.js").status_code == 200


def test_streamed_tokens_are_coloured_one_each_and_a_hover_shows_the_entropy(
    browser, server, client: openai.OpenAI, model_name: str
):
    reference = client.completions.create(
        model=model_name, prompt=GREEDY_PROMPT, max_tokens=12, temperature=0
    )
    open_page(browser, server, **{"temperature": "0", "max-tokens": "12"})
    send_and_wait(browser)
    tokens = browser.find_elements(By.CSS_SELECTOR, "#output .tok")
    assert len(tokens) == reference.usage.completion_tokens
    shown = browser.execute_script("return document.getElementById('output').textContent")
    assert shown == reference.choices[0].text
    assert all(t.value_of_css_property("background-color") != "rgba(0, 0, 0, 0)" for t in tokens)

    ActionChains(browser).move_to_element(tokens[0]).perform()
    detail = browser.find_element(By.ID, "token-detail")
    WebDriverWait(browser, 10).until(expected_conditions.visibility_of(detail))
    entropy = reference.choices[0].model_extra["etinfer"]["entropies"][0]
    assert f"{entropy:.3f} nats" in detail.text
    assert "temperature" in detail.text and "alternatives" in detail.text


def test_a_bad_field_shows_the_servers_message(browser, server, model_name: str):
    expected = post(server, COMPLETIONS, {"model": model_name, "prompt": "x", "max_tokens": -3})
    open_page(browser, server, **{"max-tokens": "-3"})
    send_and_wait(browser)
    error = browser.find_element(By.ID, "error")
    assert error.is_displayed()
    assert expected.json()["error"]["message"] in error.text
    assert "400" in error.text


def test_a_narrow_window_keeps_the_page_within_its_width_and_the_keyboard_reaches_tokens(
    browser, server
):
    browser.set_window_size(360, 800)
    try:
        open_page(browser, server, **{"temperature": "0", "max-tokens": "4"})
        send_and_wait(browser)
        overflow = browser.execute_script(
            "return document.documentElement.scrollWidth - window.innerWidth"
        )
        assert overflow <= 0
        # Tab from Send (Stop is disabled once the answer is in) lands on the first token,
        # which then shows its details.
        browser.find_element(By.ID, "send").send_keys(Keys.TAB)
        focused = browser.switch_to.active_element
        assert focused.get_attribute("class") == "tok"
        assert focused.get_attribute("data-index") == "0"
        assert browser.find_element(By.ID, "token-detail").is_displayed()
    finally:
        browser.set_window_size(1200, 1000)


def test_json_output_outlines_the_tokens_the_grammar_forced(
    browser, server, client: openai.OpenAI, model_name: str
):
    reference = client.completions.create(
        model=model_name,
        prompt=GREEDY_PROMPT,
        max_tokens=24,
        temperature=0,
        extra_body={"structured_outputs": {"json_object": True}},
    )
    forced = reference.choices[0].model_extra["etinfer"]["forced"]
    assert any(forced)
    open_page(browser, server, **{"temperature": "0", "max-tokens": "24"})
    browser.find_element(By.CSS_SELECTOR, "#output-format option[value=json]").click()
    send_and_wait(browser)
    tokens = browser.find_elements(By.CSS_SELECTOR, "#output .tok")
    assert ["forced" in t.get_attribute("class") for t in tokens] == forced
    first = tokens[forced.index(True)]
    ActionChains(browser).move_to_element(first).perform()
    detail = browser.find_element(By.ID, "token-detail")
    WebDriverWait(browser, 10).until(expected_conditions.visibility_of(detail))
    assert "forced by the grammar" in detail.text and "masked entropy" in detail.text
