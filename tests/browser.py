"""Helpers for the web pages' tests in a real browser: headless chromium (`loadtests.browser`), waiting
on the page, screenshots, and an api app with a fake engine served on a real port from a thread."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from batchserve.loadtests.browser import chromium_driver as start_chromium
from batchserve.loadtests.browser import chromium_missing
from batchserve.shared.ports import free_port

# Where a test saves its screenshots for a person to look at (default: pytest's temporary folder).
SCREENSHOT_DIR_ENV = "BATCHSERVE_SCREENSHOT_DIR"


def chromium_driver():
    """A headless chromium (`loadtests.browser`); skips the test where none can start."""
    missing = chromium_missing()
    if missing:
        pytest.skip(missing)
    return start_chromium()


def wait_for(condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll `condition` until it returns something truthy (which is returned) or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except Exception:  # the page may be re-rendering the element
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)


def save_screenshot(driver, name: str, default_dir: Path) -> Path:
    folder = Path(os.environ.get(SCREENSHOT_DIR_ENV) or default_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    driver.save_screenshot(str(path))
    print(f"screenshot: {path}")
    return path


class AppThread:
    """An aiohttp app on 127.0.0.1:PORT, run by an event loop in a thread of its own (`call` runs a function
    on that loop: the fake engine's methods are not thread-safe)."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self._thread.start()
        started.wait(10)

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self._runner = web.AppRunner(self.app, handler_cancellation=True)
        self.loop.run_until_complete(self._runner.setup())
        self.loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        started.set()
        self.loop.run_forever()

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
