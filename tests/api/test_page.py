"""The browser page in a real headless Chromium (Debian's chromium and chromium-driver), its microphone a WAV file
played in a loop: it connects to /v1/realtime, the server's turn detection commits what it heard, and it plays the
answer's speech; speech over an answer interrupts it; its chat box sends text, an image and an audio file and shows
the answers. Each test leaves a screenshot in out/test-page/."""

import json
import shutil
import time
import urllib.parse
import wave
from contextlib import contextmanager
from pathlib import Path

import pytest

from api.conftest import start_api, stop
from converse_client import speech_clip
from references import png, wav

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
SESSION = {"sampling": {"temperature": 0}, "talker": {"temperature": 0, "max_tokens": 10}, "max_output_tokens": 6}
# Answers that go on until cut: a long answer the user can speak over
LONG = {"sampling": {"temperature": 0, "ignore_eos": True}, "max_output_tokens": 250,
        "talker": {"temperature": 0, "ignore_eos": True, "max_tokens": 1000}}
SHOTS = Path(__file__).resolve().parents[2] / "out" / "test-page"


@pytest.fixture(scope="module")
def door(native_mesh, tmp_path_factory):
    d = start_api(native_mesh.config_path, tmp_path_factory.mktemp("page"), "page")
    yield d
    stop(d)


def mic_file(path, pcm: bytes, rate: int):
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
    return path


@contextmanager
def chromium(mic):
    """Headless Chromium whose microphone plays `mic` (a WAV file) in a loop."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    assert CHROMIUM and DRIVER, "chromium and chromedriver are missing: scripts/test installs Debian's packages"
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--use-fake-ui-for-media-stream",
                 "--use-fake-device-for-media-stream", f"--use-file-for-fake-audio-capture={mic}",
                 "--autoplay-policy=no-user-gesture-required", "--window-size=1000,800"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(DRIVER))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def browser(tmp_path):
    # a second of speech, then silence long enough for the answer
    mic = mic_file(tmp_path / "mic.wav", speech_clip(1.0, 0, rate=48000, silence_s=3.0), 48000)
    with chromium(mic) as driver:
        yield driver


def screenshot(driver, name: str) -> Path:
    """The page as the test left it, kept where a person (or CI) can look at it."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    assert driver.save_screenshot(str(path)), path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return path


def wait(driver, script: str, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while not (value := driver.execute_script(script)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def test_the_page_talks_and_chats(door, browser, tmp_path):
    browser.get(f"{door.url}/?session={urllib.parse.quote(json.dumps(SESSION))}")
    assert wait(browser, "return window.omni.connected"), browser.execute_script("return window.omni.events")
    browser.find_element("id", "talk").click()
    done = wait(browser, "return window.omni.done.filter(d => d.status === 'completed').length >= 2 && window.omni.done")
    events = browser.execute_script("return window.omni.events")
    assert done, events
    for kind in ("input_audio_buffer.speech_started", "input_audio_buffer.committed", "response.created",
                 "response.output_audio.delta"):
        assert kind in events, (kind, events)
    assert "input_audio_buffer.commit" not in events  # the server committed each turn by itself
    assert browser.execute_script("return window.omni.audioBytes") > 0
    assert done[1]["usage"]["input_tokens"] > done[0]["usage"]["input_tokens"]  # the second turn held the first
    browser.find_element("id", "talk").click()  # the microphone off: the chat box alone
    image = tmp_path / "picture.png"
    image.write_bytes(png(4))
    before = len(done)
    browser.find_element("id", "text").send_keys("What is this?")
    browser.find_element("id", "files").send_keys(str(image))
    browser.find_element("css selector", "#chat button").click()
    chat = wait(browser, f"return window.omni.done.length > {before} && window.omni.done[window.omni.done.length - 1]")
    assert chat and chat["status"] == "completed", browser.execute_script("return window.omni.events")
    clip = tmp_path / "clip.wav"
    clip.write_bytes(wav(5, 0.8))
    browser.find_element("id", "files").send_keys(str(clip))  # an audio file alone, decoded by the browser
    browser.find_element("css selector", "#chat button").click()
    heard = wait(browser, f"return window.omni.done.length > {before + 1} && window.omni.done[window.omni.done.length - 1]")
    assert heard and heard["status"] == "completed", [li.text for li in browser.find_elements("css selector", "#conversation li.error")]
    assert heard["usage"]["input_tokens"] > 0 and heard["usage"]["output_tokens"] > 0
    texts = [li.text for li in browser.find_elements("css selector", "#conversation li")]
    assert any("What is this? [picture.png]" in t for t in texts) and any("[clip.wav]" in t for t in texts), texts
    assert not browser.find_elements("css selector", "#conversation li.error"), texts
    screenshot(browser, "talks-and-chats")


def test_speaking_over_the_answer_interrupts_it(door, tmp_path):
    """Barge-in by voice: the microphone's speech restarts (the file loops) while the long answer to its last turn
    plays; the server stops that answer, the page counts it interrupted after it had received its audio, and the
    new speech is heard as the next turn."""
    mic = mic_file(tmp_path / "barge-in.wav", speech_clip(1.0, 1, rate=48000, silence_s=2.0), 48000)
    with chromium(mic) as browser:
        browser.get(f"{door.url}/?session={urllib.parse.quote(json.dumps(LONG))}")
        assert wait(browser, "return window.omni.connected"), browser.execute_script("return window.omni.events")
        browser.find_element("id", "talk").click()
        cut = wait(browser, "return window.omni.done.find(d => d.reason === 'turn_detected' && d.audioBytes > 0)")
        state = browser.execute_script("return window.omni")
        assert cut, (state["done"], state["events"])
        assert cut["status"] == "cancelled" and cut["transcript"].endswith("(stopped)")
        assert state["interrupted"] >= 1 and state["audioBytes"] >= cut["audioBytes"] > 0
        assert cut["usage"]["input_tokens"] > 0 and cut["usage"]["output_tokens"] > 0
        # the speech that cut it is the next turn: committed by the server and answered in its turn
        assert wait(browser, f"return window.omni.events.filter(e => e === 'response.created').length > {len(state['done'])}")
        assert "input_audio_buffer.commit" not in state["events"]
        screenshot(browser, "barge-in")
