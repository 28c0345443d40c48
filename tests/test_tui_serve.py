"""The console served to a browser by textual-serve renders (docs/console.md, "In a browser").

textual-serve is not a dependency of mirage: ``pip install textual-serve`` to run
this. It starts the server on a free port with a replay of the recorded demo,
opens the page, connects the websocket a browser would (140x45), and reads the
terminal stream until the Report screen has been drawn.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("textual_serve")
aiohttp = pytest.importorskip("aiohttp")

REPO_ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_textual_serve_renders_the_console():
    port = _free_port()
    app = f"{Path(sys.executable).parent / 'mirage-tui'} --replay tests/fixtures/runs/ddp-2gpu --speed 64"
    server = subprocess.Popen(
        [sys.executable, "-c", f"from textual_serve.server import Server; "
                               f"Server({app!r}, host='127.0.0.1', port={port}).serve()"],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )

    async def browse() -> bytes:
        async with aiohttp.ClientSession() as http:
            for _ in range(100):
                try:
                    async with http.get(f"http://127.0.0.1:{port}/") as page:
                        assert page.status == 200 and "textual" in (await page.text()).lower()
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.1)
            seen = b""
            async with http.ws_connect(f"ws://127.0.0.1:{port}/ws?width=140&height=45") as ws:
                # one deadline for the whole session: a receive() that times out marks aiohttp's
                # socket as abnormally closed, and on a loaded machine the app can be silent for a
                # second while it starts (the suite saw that fail)
                try:
                    async with asyncio.timeout(120):
                        while b"run ok: exit 0" not in seen:
                            msg = await ws.receive()
                            if msg.type == aiohttp.WSMsgType.BINARY:
                                seen += msg.data
                            elif msg.type == aiohttp.WSMsgType.TEXT:
                                seen += msg.data.encode()
                            else:
                                break
                except TimeoutError:
                    pass  # the assertion below says what was missing
                await ws.send_json(["stdin", "q"])  # the app quits; the server reaps it
                await asyncio.sleep(0.5)
            return seen

    try:
        seen = asyncio.run(browse())
    finally:
        server.terminate()
        server.wait(10)
    assert b"ddp_mlp_ok" in seen and b"run ok: exit 0" in seen
