"""The executed course as a website (`make site`): two pages read in headless Chromium, as a reader would.

The site is served from build/site/ on loopback; any request that leaves the site is refused and fails the test (it
builds and reads offline). Each page: every formula typeset by MathJax without an error, every figure loaded, every
answer folded (a click opens it), the sidebar listing the notebooks in course order, and every link on the page that
stays on the site answering, anchors included. Screenshots go to build/browser/site-NAME.png.

Run with `make test-browser`, which builds the site first.
"""

from __future__ import annotations

import contextlib
import threading
import urllib.parse
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import REPO
from tools import editions

SITE = REPO / "build" / "site"
PAGES = {"02_ddp.html": 2, "09_pipeline_parallel.html": 4}  # page: its answer folds, at least


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


@pytest.fixture(scope="module")
def site_url():
    if not (SITE / "index.html").exists():
        pytest.fail("build/site/ is missing: `make site` builds it (make test-browser does)")
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(QuietHandler, directory=str(SITE)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


TYPESET = "() => MathJax.startup.promise.then(() => true)"
MATH = """() => ({
  formulas: document.querySelectorAll('.math').length,
  typeset: document.querySelectorAll('.math mjx-container svg').length,
  errors: document.querySelectorAll('mjx-merror, [data-mjx-error]').length,
})"""
FIGURES = """() => [...document.querySelectorAll('article img')].map(i => ({src: i.src, width: i.naturalWidth}))"""
LINKS = """() => [...document.querySelectorAll('a[href]')].map(a => a.href)"""
NAV = """() => [...document.querySelectorAll('nav.bd-links a.reference.internal')].map(a => a.getAttribute('href'))"""


@pytest.mark.parametrize("name", list(PAGES))
def test_a_site_page_renders_offline_with_answers_folded(browser, site_url, artifacts, name):
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    outside, failed = [], []

    def only_the_site(route):
        if route.request.url.startswith(site_url):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", only_the_site)
    page.on("response", lambda r: r.status >= 400 and failed.append(f"{r.status} {r.url}"))
    page.on("requestfailed", lambda r: r.url.startswith(site_url) and failed.append(f"failed {r.url}"))
    try:
        page.goto(f"{site_url}/{name}", wait_until="load", timeout=60_000)
        page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise", timeout=30_000)
        page.evaluate(TYPESET)

        math = page.evaluate(MATH)
        assert math["formulas"] > 5 and math["typeset"] == math["formulas"] and math["errors"] == 0, math

        figures = page.evaluate(FIGURES)
        assert len(figures) >= 3 and [f["src"] for f in figures if f["width"] == 0] == []

        listed = [(h.split("#")[0] or name).removesuffix(".html") for h in page.evaluate(NAV)]  # "#": this page
        in_order = [p.stem for p in editions.course_notebooks()]
        assert list(dict.fromkeys(p for p in listed if p[:2].isdigit())) == in_order

        folds = page.locator("details.answer, details.hide")
        assert folds.count() >= PAGES[name]
        for i in range(folds.count()):
            fold = folds.nth(i)
            assert fold.get_attribute("open") is None, f"answer {i} is unfolded"
            assert "Show the answer" in fold.locator("summary").inner_text()
        first = folds.first
        hidden = first.locator(":scope > :not(summary)").first
        assert not hidden.is_visible()
        first.locator("summary").click()
        assert hidden.is_visible()  # a click shows it
        first.locator("summary").click()

        broken = []
        for href in sorted(set(page.evaluate(LINKS))):
            if not href.startswith(site_url):
                continue  # another site: not reachable from here, and not the course's to keep
            target, _, anchor = href.partition("#")
            if target.rstrip("/") == site_url:
                target = f"{site_url}/index.html"
            response = page.request.get(target)
            if not response.ok:
                broken.append(f"{response.status} {href}")
                continue
            anchor = urllib.parse.unquote(anchor)
            if anchor and f'id="{anchor}"' not in response.text():
                broken.append(f"no #{anchor} in {target}")
        assert broken == []
        assert outside == [] and failed == []
    finally:
        with contextlib.suppress(Exception):
            page.screenshot(path=str(artifacts / f"site-{name.removesuffix('.html')}.png"))
        page.close()
