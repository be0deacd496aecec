"""Debian's headless chromium driven by selenium through Debian's chromedriver, named explicitly (selenium's
own driver download cannot reach a closed network): for the web pages' tests and the live view's benchmark."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

CHROMIUM = os.environ.get("BATCHSERVE_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("BATCHSERVE_CHROMEDRIVER", "/usr/bin/chromedriver")
# Chromium's connections to Google's services are refused on a closed network: not tried at all.
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
)
WINDOW_SIZE = (1400, 1000)  # a laptop's browser window


def chromium_missing() -> str | None:
    """Why no browser can start here (None: it can)."""
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        return f"no {CHROMIUM} and {CHROMEDRIVER} (Debian's chromium and chromium-driver; .ci/run installs them)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (`pip install -e '.[dev]'`)"
    return None


def chromium_driver(window_size: tuple[int, int] = WINDOW_SIZE):
    """A headless chromium with a new empty profile (`quit_driver` removes it), its window `window_size`."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="batchserve-chromium-")
    for flag in (*CHROMIUM_FLAGS, f"--window-size={window_size[0]},{window_size[1]}", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    driver.profile_dir = profile
    return driver


def quit_driver(driver) -> None:
    driver.quit()
    shutil.rmtree(driver.profile_dir, ignore_errors=True)
