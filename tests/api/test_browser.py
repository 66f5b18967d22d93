"""The browser page in a real headless Chromium (Debian's chromium and chromedriver, driven by selenium), served by
the api process in front of the session's mesh: it finds the model and its voices, sends chat turns with a WAV file
attached, plays the spoken answer as it streams in (the page's own counters), keeps the conversation, shows a bad
file's error and goes on; a screenshot is written."""

import shutil
import time
import wave

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(600)


def _wav(path, seconds: float = 1.0, rate: int = 16000):
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return path


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "chromium and chromedriver are missing: scripts/setup installs Debian's packages"
    mic = _wav(tmp_path_factory.mktemp("mic") / "mic.wav", seconds=3.0)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--autoplay-policy=no-user-gesture-required",
                 "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                 f"--use-file-for-fake-audio-capture={mic}", "--window-size=1100,800"):
        options.add_argument(flag)
    d = webdriver.Chrome(service=Service(driver), options=options)
    yield d
    d.quit()


def wait_for(browser, script: str, timeout: float = 180.0):
    """The value of `script` once it is truthy; fails with the page's state after `timeout`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = browser.execute_script(script)
        if value:
            return value
        time.sleep(0.2)
    state = browser.execute_script("return [window.omni, [...document.querySelectorAll('.turn.error')].map(e => e.textContent)]")
    raise AssertionError(f"{script!r} stayed false: counters {state[0]}, errors shown {state[1]}")


def counters(browser) -> dict:
    return browser.execute_script("return Object.assign({}, window.omni)")


def send(browser, text: str, *files):
    from selenium.webdriver.common.by import By

    browser.find_element(By.ID, "text").send_keys(text)
    if files:
        browser.find_element(By.ID, "files").send_keys("\n".join(str(f) for f in files))
    browser.find_element(By.ID, "send").click()


def test_the_page_talks_with_the_mesh_and_plays_its_speech(api, browser, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get(api.url + "/")
    assert wait_for(browser, "return document.getElementById('model').textContent") == "tiny"
    voices = [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#voice option")]
    assert voices and browser.find_element(By.ID, "voice").get_attribute("value") in voices

    browser.find_element(By.ID, "maxTokens").send_keys("12")  # three turns fit the tiny model's context
    send(browser, "Describe this sound.", _wav(tmp_path / "tone.wav"))
    wait_for(browser, "return window.omni.answers >= 1")
    first = counters(browser)
    assert first["errors"] == 0 and first["audioChunks"] > 0 and first["audioBytes"] > 0, first
    assert first["scheduledSeconds"] == pytest.approx(first["audioBytes"] / 2 / 24000, rel=1e-3)
    # Heard, not only received: the page's audio clock runs
    assert browser.execute_script("return document.querySelector('.turn.user').textContent").startswith("[audio]")
    t0 = browser.execute_script("return window.omniPlayer.ctx.currentTime")
    time.sleep(0.5)
    assert browser.execute_script("return window.omniPlayer.ctx.state") == "running"
    assert browser.execute_script("return window.omniPlayer.ctx.currentTime") > t0

    send(browser, "And once more.")
    wait_for(browser, "return window.omni.answers >= 2")
    assert browser.execute_script("return window.omniHistory.length") == 4  # two user turns, two answers
    assert counters(browser)["audioBytes"] > first["audioBytes"]

    bad = tmp_path / "notes.txt"
    bad.write_text("not media")
    send(browser, "What is this?", bad)
    wait_for(browser, "return window.omni.errors >= 1")
    assert "notes.txt: not an image, audio or video file" in browser.find_element(By.CSS_SELECTOR, ".turn.error").text
    browser.execute_script("document.getElementById('files').value = ''")
    send(browser, "Still there?")
    wait_for(browser, "return window.omni.answers >= 3")
    assert browser.execute_script("return window.omniHistory.length") == 6
    shot = tmp_path / "page.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")
