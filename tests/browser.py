"""Headless Chromium driven over the DevTools protocol (a websocket; aiohttp's client), for the dashboard test.

``unavailable()`` says why no browser can run here (installing Debian's ``chromium`` with apt-get where it can);
:class:`Browser` opens one page, collects its console errors and uncaught exceptions, evaluates expressions in it
and takes screenshots. The browser runs with a throwaway profile and is killed (its process group) on close.
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
import tempfile
import time
from pathlib import Path

import aiohttp

import debian

NAMES = ("chromium", "chromium-browser", "google-chrome")


def executable() -> str | None:
    return next((p for p in map(shutil.which, NAMES) if p), None)


def unavailable() -> str | None:
    """Why the browser test cannot run here (None if it can). Installs chromium with apt-get where missing."""
    if executable() is None:
        debian.ensure({"chromium": "chromium"})
    if executable() is None:
        return "no Chromium here, and it could not be installed (apt-get install chromium, as root)"
    return None


class Browser:
    def __init__(self) -> None:
        self.profile = Path(tempfile.mkdtemp(prefix="swarmd-chromium-"))
        self.proc: subprocess.Popen | None = None
        self.session: aiohttp.ClientSession | None = None
        self.ws = None
        self.ids = itertools.count(1)
        self.waiting: dict[int, asyncio.Future] = {}
        self.errors: list[str] = []  # console errors, uncaught exceptions, failed loads
        self.reader: asyncio.Task | None = None

    async def start(self, timeout: float = 60.0) -> None:
        self.proc = subprocess.Popen(
            [executable(), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
             "--window-size=1280,1400", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
            # its scratch files (/tmp/org.chromium.Chromium.*: the singleton socket, killed before it removes it) go
            # into the profile, removed by close(), not left behind in the system's temporary directory
            env={**os.environ, "TMPDIR": str(self.profile)})
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited: {self.proc.stderr.read().decode(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not open its DevTools port")
            await asyncio.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        self.session = aiohttp.ClientSession()
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as r:
            pages = [t for t in await r.json() if t["type"] == "page"]
        self.ws = await self.session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=64 << 20)
        self.reader = asyncio.create_task(self._read())
        for method in ("Runtime.enable", "Log.enable", "Page.enable"):
            await self.send(method)

    async def _read(self) -> None:
        async for msg in self.ws:
            data = json.loads(msg.data)
            if "id" in data:
                fut = self.waiting.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
            elif data.get("method") == "Runtime.exceptionThrown":
                d = data["params"]["exceptionDetails"]
                self.errors.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
            elif data.get("method") == "Runtime.consoleAPICalled" and data["params"]["type"] in ("error", "assert"):
                self.errors.append("console: " + " ".join(str(a.get("value", a.get("description")))
                                                         for a in data["params"]["args"]))
            elif data.get("method") == "Log.entryAdded" and data["params"]["entry"]["level"] == "error":
                entry = data["params"]["entry"]
                self.errors.append(f"log: {entry.get('text')} {entry.get('url', '')}")

    async def send(self, method: str, **params) -> dict:
        i = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.waiting[i] = fut
        await self.ws.send_str(json.dumps({"id": i, "method": method, "params": params}))
        reply = await asyncio.wait_for(fut, 30)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)

    async def eval(self, expression: str):
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    async def wait(self, expression: str, timeout: float, what: str, interval: float = 0.2):
        """Poll a JavaScript expression until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        last_error = None
        while time.monotonic() < deadline:
            try:
                value = await self.eval(expression)
                if value:
                    return value
            except RuntimeError as e:  # the page is (re)loading
                last_error = e
            await asyncio.sleep(interval)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}"
                           + (f" (last error: {last_error})" if last_error else ""))

    async def screenshot(self, path: Path, width: int | None = None, height: int | None = None) -> None:
        if width:
            await self.send("Emulation.setDeviceMetricsOverride", width=width, height=height or 900,
                            deviceScaleFactor=1, mobile=width < 600)
        shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        if self.ws is not None:
            await self.ws.close()
        if self.session is not None:
            await self.session.close()
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        shutil.rmtree(self.profile, ignore_errors=True)


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


