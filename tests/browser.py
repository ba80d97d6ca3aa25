"""A headless Chromium driven over the DevTools protocol, for tests of the dashboard page.

Where it runs: the test process: Chromium is a child process; its DevTools websocket is
spoken with tornado's client (a dependency of distributed) on a private event loop, one
command at a time.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tornado.websocket import websocket_connect

#: Names under which Debian and others install Chromium
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_browser() -> str | None:
    """The path of a Chromium on this machine, if there is one."""
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    return None


async def _connect(url: str) -> Any:
    return await websocket_connect(url, max_message_size=256 * 2**20)


async def _close(ws: Any) -> None:
    ws.close()


class Browser:
    """**Loop-confined (its own loop).** One headless Chromium with one page.

    Use as a context manager; :meth:`open` loads a URL, :meth:`evaluate` runs JavaScript in
    the page and returns its JSON-decoded value, :meth:`screenshot` saves a PNG.
    """

    def __init__(self, executable: str, width: int = 1400, height: int = 1000) -> None:
        self._profile = tempfile.mkdtemp(prefix="rechunk-p2p-chromium-")
        self._process = subprocess.Popen(
            [
                executable,
                "--headless=new",
                "--no-sandbox",  # tests may run as root (a container)
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-port=0",
                f"--user-data-dir={self._profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._loop = asyncio.new_event_loop()
        self._ids = itertools.count(1)
        self._ws: Any = None
        try:
            self._ws = self._loop.run_until_complete(_connect(self._page_socket()))
        except BaseException:
            self.close()
            raise

    def _page_socket(self, timeout: float = 30.0) -> str:
        """The DevTools websocket of the browser's page, once Chromium listens."""
        port_file = Path(self._profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"Chromium exited with {self._process.returncode}")
            if port_file.exists() and (lines := port_file.read_text().split()):
                listing = f"http://127.0.0.1:{lines[0]}/json/list"
                with urllib.request.urlopen(listing, timeout=10) as reply:
                    targets = json.load(reply)
                pages = [t for t in targets if t.get("type") == "page"]
                if pages:
                    return pages[0]["webSocketDebuggerUrl"]
            time.sleep(0.1)
        raise TimeoutError(f"Chromium did not open its DevTools port within {timeout} s")

    def _call(self, method: str, **params: Any) -> dict:
        return self._loop.run_until_complete(self._call_async(method, params))

    async def _call_async(self, method: str, params: dict) -> dict:
        ident = next(self._ids)
        await self._ws.write_message(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = await asyncio.wait_for(self._ws.read_message(), 60)
            if message is None:
                raise RuntimeError("Chromium closed its DevTools connection")
            reply = json.loads(message)
            if reply.get("id") == ident:  # events (no id) and others are skipped
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def open(self, url: str) -> None:
        """Load ``url`` in the page."""
        self._call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (it must give a JSON string)."""
        result = self._call("Runtime.evaluate", expression=expression, returnByValue=True)
        value = result.get("result", {}).get("value")
        return json.loads(value) if isinstance(value, str) else value

    def screenshot(self, path: str | os.PathLike) -> bytes:
        """Save the page as a PNG at ``path``; its bytes."""
        data = base64.b64decode(self._call("Page.captureScreenshot", format="png")["data"])
        Path(path).write_bytes(data)
        return data

    def close(self) -> None:
        if self._ws is not None:  # on the browser's loop (else tornado makes one to close it)
            self._loop.run_until_complete(_close(self._ws))
        self._process.terminate()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(10)
        self._loop.close()
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
