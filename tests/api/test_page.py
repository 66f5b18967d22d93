"""The browser page in a real headless Chromium (Debian's chromium and chromium-driver), its microphone a WAV file
played in a loop: it connects to /v1/realtime, the server's turn detection commits what it heard, and it plays the
answer's speech; its chat box sends text, an image and an audio file and shows the answers."""

import json
import shutil
import time
import urllib.parse
import wave

import pytest

from api.conftest import start_api, stop
from converse_client import speech_clip
from references import png, wav

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
SESSION = {"sampling": {"temperature": 0}, "talker": {"temperature": 0, "max_tokens": 10}, "max_output_tokens": 6}


@pytest.fixture(scope="module")
def door(native_mesh, tmp_path_factory):
    d = start_api(native_mesh.config_path, tmp_path_factory.mktemp("page"), "page")
    yield d
    stop(d)


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    assert CHROMIUM and DRIVER, "chromium and chromedriver are missing: scripts/test installs Debian's packages"
    mic = tmp_path / "mic.wav"
    with wave.open(str(mic), "wb") as w:  # a second of speech, then silence long enough for the answer
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(48000)
        w.writeframes(speech_clip(1.0, 0, rate=48000, silence_s=3.0))
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--use-fake-ui-for-media-stream",
                 "--use-fake-device-for-media-stream", f"--use-file-for-fake-audio-capture={mic}",
                 "--autoplay-policy=no-user-gesture-required"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(DRIVER))
    yield driver
    driver.quit()


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
