"""Pages opened as a person opens them: Debian's headless Chromium, driven by Playwright.

Where Chromium is not installed the checks are skipped, unless MSD_REQUIRE_BROWSER is set (CI
installs Chromium and sets it, so there they always run)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# as root and on a closed network: no sandbox, and none of Chromium's own background requests
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


def require_browser() -> None:
    try:
        import playwright  # noqa: F401
    except ImportError:
        available = False
    else:
        available = os.path.exists(CHROMIUM)
    if not available:
        message = f"headless Chromium ({CHROMIUM}) and playwright are needed to look at pages"
        if os.environ.get("MSD_REQUIRE_BROWSER"):
            pytest.fail(message)
        pytest.skip(message)


@dataclass
class Seen:
    url: str
    errors: list[str] = field(default_factory=list)  # console errors, page errors, failed requests
    scroll_width: int = 0  # wider than the viewport: a horizontal scroll bar
    images: list[tuple[str, int, int]] = field(default_factory=list)  # (alt or src, natural width, shown width)
    title: str = ""
    cut_code: list[str] = field(default_factory=list)  # code blocks whose lines hide behind a scroll bar
    broken_names: list[str] = field(default_factory=list)  # reference names broken inside a word


# Code blocks wider than their box, and names (code.msd-name, tools/docgen.py) whose text moves to a
# new line anywhere but right after a "." or a "_".
_CODE_CHECK = """() => {
  const cut = Array.from(document.querySelectorAll('pre > code'))
    .filter(c => c.scrollWidth > c.clientWidth + 1)
    .map(c => c.innerText.split('\\n').sort((a, b) => b.length - a.length)[0].slice(0, 80));
  const broken = [];
  for (const code of document.querySelectorAll('code.msd-name')) {
    if (code.getClientRects().length < 2) continue;
    const text = code.textContent;
    let top = null, at = 0;
    const walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (let i = 0; i < node.length; i++, at++) {
        const r = document.createRange();
        r.setStart(node, i); r.setEnd(node, i + 1);
        const y = r.getBoundingClientRect().top;
        if (top !== null && y > top + 2 && !'._'.includes(text[at - 1])) broken.push(text);
        top = y;
      }
    }
  }
  return [cut, broken];
}"""


def look(urls: list[str], width: int = 1280, screenshot: dict[str, str] | None = None) -> list[Seen]:
    """Open each page at `width` pixels; what a person would notice. `screenshot`: url -> PNG path."""
    from playwright.sync_api import sync_playwright

    seen = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            for url in urls:
                s = Seen(url)
                page = browser.new_page(viewport={"width": width, "height": 900})
                page.on("console", lambda m, s=s: m.type == "error" and s.errors.append(f"console: {m.text}"))
                page.on("pageerror", lambda e, s=s: s.errors.append(f"page error: {e}"))
                page.on("requestfailed", lambda r, s=s: s.errors.append(f"request failed: {r.url} {r.failure}"))
                page.goto(url, wait_until="load")
                s.title = page.title()
                s.scroll_width = page.evaluate("document.documentElement.scrollWidth")
                s.cut_code, s.broken_names = page.evaluate(_CODE_CHECK)
                s.images = [tuple(x) for x in page.evaluate(
                    "Array.from(document.images).map(i => [i.alt || i.src.slice(0, 60), i.naturalWidth, i.width])")]
                if screenshot and url in screenshot:
                    page.screenshot(path=screenshot[url], full_page=True)
                page.close()
                seen.append(s)
        finally:
            browser.close()
    return seen
