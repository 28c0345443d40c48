"""A real browser for tests: headless Chromium (Debian's ``chromium``) driven over the DevTools protocol.

Only what the console tests need: open a URL, take screenshots until one satisfies a check.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import aiohttp

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


async def _screenshots(url: str, profile: Path, size: tuple[int, int], good, timeout: float) -> bytes:
    browser = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0",
         f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
                page = next(t for t in await r.json() if t["type"] == "page")
            async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                ids = itertools.count(1)

                async def call(method: str, **params) -> dict:
                    n = next(ids)
                    await ws.send_str(json.dumps({"id": n, "method": method, "params": params}))
                    while True:
                        msg = json.loads((await ws.receive()).data)
                        if msg.get("id") == n:
                            assert "error" not in msg, msg
                            return msg["result"]

                await call("Page.enable")
                await call("Page.navigate", url=url)
                deadline = time.monotonic() + timeout
                while True:
                    await asyncio.sleep(1)
                    png = base64.b64decode((await call("Page.captureScreenshot", format="png"))["data"])
                    if good(png) or time.monotonic() > deadline:
                        return png
    finally:
        os.killpg(browser.pid, signal.SIGKILL)
        browser.wait()


def screenshot(url: str, profile: Path, good, size: tuple[int, int] = (1400, 900), timeout: float = 60) -> bytes:
    """Open ``url`` in headless Chromium and screenshot it each second until ``good(png)`` (or ``timeout``);
    the last screenshot. ``profile``: an empty folder for the browser's profile."""
    assert CHROMIUM is not None, "chromium is not installed"
    return asyncio.run(_screenshots(url, profile, size, good, timeout))
