"""`omnistage demo` in a real headless Chromium (Debian's chromium + chromedriver, selenium):
the page in front of a cascade server (real speech: flite, pocketsphinx) sends a text chat and
shows the answer; the microphone, fed from a WAV by Chromium's fake capture device, records a
spoken question that the voice tab answers with text and speech and the transcription tab
hears back. Screenshots of each tab go to the test's folder (and, with
OMNISTAGE_DEMO_SHOTS=DIR, there)."""

from __future__ import annotations

import contextlib
import os
import shutil
import time

import openai
import pytest

from tests.models.cascade.test_cascade import QUESTION, wav_bytes, wer
from tests.server.conftest import free_port

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                reason="needs Debian's chromium and chromium-driver (apt)")
WAIT_S = 120


@contextlib.contextmanager
def launched(base: str, api_key: str):
    """The demo page for the server at `base`: (its URL, the page's openai client)."""
    from omnistage.demo import build_demo

    client = openai.OpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0, timeout=120)
    demo = build_demo(client)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/", client
    finally:
        demo.close()


@pytest.fixture(scope="module")
def page(tiny_qwen2, start_server, api_key):
    with start_server(f"cascade:pocketsphinx+{tiny_qwen2}+flite") as running, \
            launched(running.base, api_key) as (url, _):
        yield url


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Chromium whose microphone plays the spoken question (48 kHz WAV, then TAIL_S of silence,
    looped) and whose permission prompts are granted."""
    import numpy as np
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    from omnistage.media.audio import resample
    from omnistage.models.cascade.speech_tools import FliteTTS

    said = FliteTTS().speak(QUESTION, "slt")
    mic = tmp_path_factory.mktemp("mic") / "question.wav"
    mic.write_bytes(wav_bytes(np.concatenate([resample(said.samples, said.sample_rate, 48000),
                                              np.zeros(48000 * TAIL_S, np.float32)]), 48000))
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000",
                 "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                 f"--use-file-for-fake-audio-capture={mic}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def _shot(driver, folder, name: str) -> None:
    driver.save_screenshot(str(folder / f"{name}.png"))
    extra = os.environ.get("OMNISTAGE_DEMO_SHOTS")
    if extra:
        driver.save_screenshot(os.path.join(extra, f"{name}.png"))


def _open_tab(driver, page: str, label: str):
    """Load the page, open the tab named `label`; -> the test's bounded wait."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(page)
    wait = WebDriverWait(driver, WAIT_S)
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "button[role='tab']")))
    for button in driver.find_elements(By.CSS_SELECTOR, "button[role='tab']"):
        if button.text.strip() == label:
            button.click()
            return wait
    raise AssertionError(f"no tab {label!r}")


def test_text_chat_in_the_browser(page, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(page)
    wait = WebDriverWait(browser, WAIT_S)
    box = wait.until(ec.element_to_be_clickable((By.CSS_SELECTOR, "#chat-input textarea")))
    box.send_keys("Hello there")
    browser.find_element(By.ID, "chat-send").click()
    wait.until(lambda d: len(_bot_messages(d)) >= 1 and _bot_messages(d)[-1].strip())
    _shot(browser, tmp_path, "text_chat")
    assert "Hello there" in browser.find_element(By.ID, "chat-log").text


def _bot_messages(driver) -> list[str]:
    from selenium.webdriver.common.by import By

    return [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#chat-log .bot")]


def _record(driver, wait, where: str) -> None:
    """Record from the (fake) microphone for the question's length: the recording is of real
    time passing, so the test waits that long, once."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec

    wait.until(ec.element_to_be_clickable((By.CSS_SELECTOR, f"{where} button.record-button"))).click()
    time.sleep(RECORD_S)
    driver.find_element(By.CSS_SELECTOR, f"{where} button.stop-button").click()
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, f"{where} audio")))


RECORD_S = 3.0      # the question (~2 s of flite speech) and some of the silence after it
# Each recording starts at the file's start, but on a loaded machine the stop click can land
# seconds late; the fake device loops the file, so a short tail let a late stop hear the
# question's first words again. A long tail keeps any late stop inside the silence.
TAIL_S = 30


def test_voice_chat_from_the_microphone(page, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec

    wait = _open_tab(browser, page, "Voice chat")
    _record(browser, wait, "#voice-in")
    browser.find_element(By.ID, "voice-send").click()
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#voice-text textarea").get_attribute("value").strip())
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#voice-out audio")))
    _shot(browser, tmp_path, "voice_chat")


def test_transcription_hears_the_microphone(page, browser, tmp_path):
    from selenium.webdriver.common.by import By

    wait = _open_tab(browser, page, "Transcription")
    _record(browser, wait, "#asr-in")
    browser.find_element(By.ID, "asr-send").click()
    heard = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#asr-out textarea").get_attribute("value").strip())
    _shot(browser, tmp_path, "transcription")
    assert wer(QUESTION, heard) <= 0.3, heard            # the microphone's audio reached the ASR


def test_speech_tab(page, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec

    wait = _open_tab(browser, page, "Speech")
    wait.until(ec.element_to_be_clickable((By.CSS_SELECTOR, "#speech-input textarea"))).send_keys("Hello there.")
    browser.find_element(By.ID, "speech-send").click()
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#speech-out audio")))
    _shot(browser, tmp_path, "speech")


@pytest.fixture(scope="module")
def image_page(start_server, api_key):
    from omnistage.entrypoints.model_source import tiny_checkpoint

    with start_server(str(tiny_checkpoint("qwen_image")), "--max-diffusion-steps", "4") as running, \
            launched(running.base, api_key) as page_and_client:
        yield page_and_client


def test_image_previews_then_the_image_and_edits(image_page, start_server, api_key, tmp_path):
    """The image tab's action: the denoising's previews, then the image ("done"); with an input
    image on an edit model, the same through /v1/images/edits."""
    from PIL import Image

    from omnistage.demo import DemoActions, served_model
    from omnistage.entrypoints.model_source import tiny_checkpoint

    _, client = image_page
    steps = list(DemoActions(client, served_model(client)).image("a red cube", "64x64", 4))
    assert [note for _, note in steps] == ["denoising: preview 1", "denoising: preview 2", "done"]
    assert all(picture.size == (64, 64) for picture, _ in steps)
    source = tmp_path / "in.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(source)
    with start_server(str(tiny_checkpoint("qwen_image_edit_plus")), "--max-diffusion-steps", "4") as running:
        editor = openai.OpenAI(base_url=f"{running.base}/v1", api_key=api_key, max_retries=0, timeout=120)
        edited = list(DemoActions(editor, served_model(editor)).image("make it blue", "64x64", 2, str(source)))
    assert edited[-1][1] == "done" and edited[-1][0].size == (64, 64)


def test_image_generation_in_the_browser(image_page, browser, tmp_path):
    """A tiny image model's page has only the image tab; a generated image is rendered, and a
    size the server refuses shows the server's message."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(image_page[0])
    wait = WebDriverWait(browser, WAIT_S)
    prompt = wait.until(ec.element_to_be_clickable((By.CSS_SELECTOR, "#image-prompt textarea")))
    assert [b.text.strip() for b in browser.find_elements(By.CSS_SELECTOR, "button[role='tab']")] == ["Image"]
    prompt.send_keys("a red cube")
    size = browser.find_element(By.CSS_SELECTOR, "#image-size textarea")
    size.clear()
    size.send_keys("64x64")
    browser.find_element(By.ID, "image-send").click()
    img = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#image-out img")))
    wait.until(lambda d: d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) == 64)
    wait.until(lambda d: d.find_element(By.ID, "image-note").text.strip() == "done")
    _shot(browser, tmp_path, "image")
    size.clear()
    size.send_keys("64x63")
    browser.find_element(By.ID, "image-send").click()
    # (the note still shows the last run's "done" until this run's answer replaces it)
    refused = "The server refused:"
    wait.until(lambda d: d.find_element(By.ID, "image-note").text.strip().startswith(refused))
    assert "size" in browser.find_element(By.ID, "image-note").text


@pytest.fixture(scope="module")
def video_page(start_server, api_key):
    from omnistage.entrypoints.model_source import tiny_checkpoint

    flags = ("--max-video-frames", "17", "--max-diffusion-steps", "4")
    with start_server(str(tiny_checkpoint("wan")), *flags) as running, launched(running.base, api_key) as (url, _):
        yield url


def test_video_job_in_the_browser(video_page, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(video_page)
    wait = WebDriverWait(browser, WAIT_S)
    prompt = wait.until(ec.element_to_be_clickable((By.CSS_SELECTOR, "#video-prompt textarea")))
    prompt.send_keys("a wave")
    for where, value in (("#video-size textarea", "48x32"), ("#video-seconds textarea", "1")):
        box = browser.find_element(By.CSS_SELECTOR, where)
        box.clear()
        box.send_keys(value)
    browser.find_element(By.ID, "video-send").click()
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#video-out video")))
    assert "completed: 100%" in browser.find_element(By.ID, "video-status").text
    _shot(browser, tmp_path, "video")
