"""A real headless browser (Debian's chromium, driven by Playwright) for tests of HTML pages."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium() -> str | None:
    """The system's chromium, or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class Rendered:
    """What the browser saw.

    Attributes:
        console_errors: console messages of type error, and uncaught page errors.
        requests: every URL the page asked for, itself included.
        failed: URLs whose loading failed.
        images: ``(alt, complete, natural width, natural height)`` of every <img>.
        title: the page's title.
        text: the page's visible text.
    """

    console_errors: list[str]
    requests: list[str]
    failed: list[str]
    images: list[tuple[str, bool, int, int]]
    title: str
    text: str


def render(page_path: Path, screenshot: Path, width: int = 1280) -> Rendered:
    """Opens ``page_path`` in a new profile, waits for it to load, and takes a full-page screenshot."""
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    requests: list[str] = []
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile, sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            profile, executable_path=chromium(), headless=True, args=FLAGS, viewport={"width": width, "height": 900}
        )
        try:
            page = context.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.on("requestfailed", lambda r: failed.append(r.url))
            page.goto(page_path.resolve().as_uri(), wait_until="load")
            images = page.evaluate(
                "() => [...document.images].map(i => [i.alt, i.complete, i.naturalWidth, i.naturalHeight])"
            )
            page.screenshot(path=str(screenshot), full_page=True)
            title, text = page.title(), page.inner_text("body")
        finally:
            context.close()
    return Rendered(errors, requests, failed, [tuple(i) for i in images], title, text)
