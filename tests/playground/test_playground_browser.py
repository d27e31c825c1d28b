"""The playground page in a real browser (Debian's chromium, headless, driven by Playwright): the
numbers and charts it draws are the API's, a moved slider redraws them with a visible progress
state, it fits a phone; the fleet view follows a real `radixserve route` and `serve --sim` workers.
Each view is written as a screenshot (into RADIXSERVE_SCREENSHOTS if set, else a tmp dir)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip(
        f"{CHROMIUM} is missing: `apt-get install -y chromium` (.ci/run does)",
        allow_module_level=True,
    )
sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (dev extra)")

from test_playground import Playground, ndjson  # noqa: E402
from test_router_fleet import RouterProc, WorkerProc, launch_worker, load  # noqa: E402

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
LAPTOP, PHONE = {"width": 1400, "height": 1000}, {"width": 390, "height": 844}


@pytest.fixture(scope="module")
def browser():
    profile = tempfile.mkdtemp(prefix="radixserve-chromium-")
    with sync_api.sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, args=ARGS, headless=True, viewport=LAPTOP
        )
        yield ctx
        ctx.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def shots(tmp_path) -> Path:
    out = Path(os.environ.get("RADIXSERVE_SCREENSHOTS", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    return out


def open_page(browser, url: str):
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    return page, errors


def wait_done(page, after: int = 0) -> None:
    """Until every simulation of a recompute started after ``after`` has been drawn."""
    page.wait_for_function(
        f"window.playground.done > {after} && !document.body.dataset.busy", timeout=60_000
    )


def post(pg: Playground, path: str, params: dict) -> bytes:
    status, data = pg.call("POST", path, params)
    assert status == 200, data
    return data


def check_drawn_equals_api(page, pg: Playground) -> dict:
    """The table, the comparison chart and both sweep charts hold what the API returns for the
    settings the page sent; returns those settings."""
    params = page.evaluate("window.playground.last.compare.params")
    api = json.loads(post(pg, "/api/compare", params))["results"]
    drawn = page.evaluate("window.playground.charts['chart-compare'].data.datasets[0].data")
    assert drawn == [r["hit_rate"] for r in api]
    for r in api:
        cell = page.inner_text(f"#compare-table tr[data-policy='{r['policy']}'] .hit")
        assert cell == f"{100 * r['hit_rate']:.1f}%"
    curve = [m["point"] for m in ndjson(post(pg, "/api/curve", params))]
    lines = page.evaluate(
        "window.playground.charts['chart-curve'].data.datasets.map(d => [d.label, d.data])"
    )
    for label, points in lines:
        want = [{"x": p["shared_prob"], "y": p["hit_rate"]} for p in curve if p["policy"] == label]
        assert points == want
    trade = [m["point"] for m in ndjson(post(pg, "/api/tradeoff", params))]
    drawn = page.evaluate("window.playground.charts['chart-tradeoff'].data.datasets[0].data")
    assert [(d["x"], d["y"]) for d in drawn] == [(p["wait_p99_s"], p["hit_rate"]) for p in trade]
    return params


@pytest.fixture(scope="module")
def playground():
    pg = Playground()
    yield pg
    pg.stop()


def test_slider_redraws_what_the_api_says(browser, playground, shots):
    page, errors = open_page(browser, playground.url)
    wait_done(page)
    before = check_drawn_equals_api(page, playground)
    assert before["shared_prob"] == 0.9 and before["policies"] == ["fcfs", "lpm"]
    # the bound starts at the server's default, and the page says that it is the server's
    assert before["max_wait_ms"] == 1000 and page.inner_text("#max_wait_ms-value") == "1000 ms"
    note = page.inner_text("#max_wait_ms-note")
    assert "1000 ms, the default of radixserve serve --max-wait-ms" in note
    trace = page.evaluate("window.playground.last.trace.policies")
    assert trace == json.loads(post(playground, "/api/trace", before))["policies"]
    page.screenshot(path=str(shots / "playground.png"), full_page=True)
    curve_before = page.evaluate("window.playground.charts['chart-curve'].data.datasets[1].data")
    table_before = page.inner_text("#compare-table tbody")
    # watch the progress state while the page recomputes after the slider moves
    page.evaluate(
        """() => { window.seen = [];
        new MutationObserver(() => seen.push(document.getElementById('progress').dataset.state))
          .observe(document.getElementById('progress'), {attributes: true}); }"""
    )
    done = page.evaluate("window.playground.done")
    page.focus("#shared_prob")
    for _ in range(6):
        page.keyboard.press("ArrowLeft")  # 0.9 -> 0.6, as a user's arrow keys move it
    page.focus("#num_prefixes")
    page.keyboard.press("ArrowRight")  # 8 -> 9 prefixes: the curve's stream changes too
    wait_done(page, done)
    after = check_drawn_equals_api(page, playground)
    assert (after["shared_prob"], after["num_prefixes"]) == (0.6, 9)
    assert page.inner_text("#compare-table tbody") != table_before
    assert page.evaluate("window.playground.charts['chart-curve'].data.datasets[1].data") != (
        curve_before
    )
    assert "running" in page.evaluate("window.seen")
    assert page.inner_text("#shared_prob-value") == "0.6"
    assert errors == []
    page.close()


def test_policies_and_bound_from_the_page(browser, playground):
    page, errors = open_page(browser, playground.url)
    wait_done(page)
    done = page.evaluate("window.playground.done")
    page.check("input[name=policy][value=dfs-weight]")
    page.focus("#max_wait_ms")
    page.keyboard.press("End")  # the last stop: unbounded
    wait_done(page, done)
    params = check_drawn_equals_api(page, playground)
    assert params["max_wait_ms"] is None and params["policies"] == ["dfs-weight", "fcfs", "lpm"]
    assert page.inner_text("#max_wait_ms-value") == "unbounded"
    titles = page.locator(".trace-policy h3").all_inner_texts()
    assert [t.split(":")[0] for t in titles] == ["dfs-weight", "fcfs", "lpm"]
    assert titles[1].startswith("fcfs: 2 of 6") and titles[2].startswith("lpm: 4 of 6")
    assert errors == []
    page.close()


# every fillText of every canvas, with the box the text covers (in the canvas' user space, the
# one Chart.js gives its points in): what the charts wrote, read without trusting the page's code
RECORD_TEXT = """(() => {
  const fill = CanvasRenderingContext2D.prototype.fillText;
  window.drawnTexts = [];
  CanvasRenderingContext2D.prototype.fillText = function (text, x, y, ...rest) {
    const m = this.measureText(text);
    window.drawnTexts.push({ canvas: this.canvas.id, text: String(text), box: [
      x - m.actualBoundingBoxLeft, y - m.actualBoundingBoxAscent,
      x + m.actualBoundingBoxRight, y + m.actualBoundingBoxDescent] });
    return fill.call(this, text, x, y, ...rest);
  };
})()"""


def overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


@pytest.mark.parametrize("viewport", [LAPTOP, PHONE], ids=["laptop", "phone"])
def test_fairness_bound_labels_are_readable(browser, playground, viewport):
    """At the defaults (where "0 ms = 10 ms" and "30 ms" used to be drawn over each other) no two
    bound labels of the trade-off chart overlap, none covers a point, all stay on the canvas."""
    page = browser.new_page()
    page.set_viewport_size(viewport)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.add_init_script(RECORD_TEXT)
    page.goto(playground.url)
    wait_done(page)
    chart = "window.playground.charts['chart-tradeoff']"
    page.evaluate(f"window.drawnTexts = []; {chart}.update('none')")  # one draw, recorded
    texts = page.evaluate("window.drawnTexts.filter(t => t.canvas === 'chart-tradeoff')")
    labels = [
        t for t in texts if re.fullmatch(r"(\d+ ms|unbounded)( = (\d+ ms|unbounded))*", t["text"])
    ]
    bounds = page.evaluate(f"{chart}.data.datasets[0].data.map(d => d.bound)")
    named = [n for t in labels for n in t["text"].split(" = ")]
    assert sorted(named) == sorted("unbounded" if b is None else f"{b:g} ms" for b in bounds)
    points = page.evaluate(f"{chart}.getDatasetMeta(0).data.map(p => [p.x, p.y])")
    width, height = page.evaluate(f"[{chart}.width, {chart}.height]")
    for i, a in enumerate(labels):
        x0, y0, x1, y1 = a["box"]
        assert 0 <= x0 and x1 <= width and 0 <= y0 and y1 <= height, a
        for b in labels[i + 1 :]:
            assert not overlap(a["box"], b["box"]), (a, b)
        for x, y in points:  # the marker, radius 5
            assert not overlap(a["box"], [x - 5, y - 5, x + 5, y + 5]), (a, (x, y))
    assert errors == []
    page.close()


def test_phone_width_fits(browser, playground, shots):
    page, errors = open_page(browser, playground.url)
    page.set_viewport_size(PHONE)
    wait_done(page)
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"], f"the page scrolls sideways on a phone: {width}px"
    box = page.locator("#chart-curve").bounding_box()
    assert box and box["width"] <= PHONE["width"] and box["height"] > 100
    page.screenshot(path=str(shots / "playground-phone.png"), full_page=True)
    assert errors == []
    page.close()


def get(addr: str, path: str) -> str:
    conn = http.client.HTTPConnection(addr.removeprefix("http://"), timeout=30)
    conn.request("GET", path)
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def kv_events_worker() -> WorkerProc:
    """A `serve --sim` worker that publishes its KV events (on free loopback ports)."""
    cfg = {"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}
    worker = WorkerProc(
        [sys.executable, "-m", "radixserve", "serve", "--sim", "tiny-cpu", "--port", "0",
         "--log-level", "warning", "--kv-events-config", json.dumps(cfg)]
    )  # fmt: skip
    worker.url = worker.wait_line(r"serving \S+ on (http://\S+)").group(1)
    return worker


def send(addr: str, n: int) -> list[int]:
    """Statuses of ``n`` requests through the router, from a thread of its own (Playwright's
    sync API keeps an event loop running in this one)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(load(addr, n, 4))).result()


@pytest.fixture
def fleet_procs():
    procs: list = []
    yield procs
    for p in procs:
        p.stop()


def test_fleet_view_follows_the_router(browser, fleet_procs, shots):
    with ThreadPoolExecutor(2) as pool:  # the two start at once; each one started is stopped
        futures = [pool.submit(launch_worker), pool.submit(kv_events_worker)]
    fleet_procs.extend(f.result() for f in futures if f.exception() is None)
    workers = [f.result() for f in futures]
    router = RouterProc([w.url for w in workers])
    fleet_procs.append(router)
    assert send(router.addr, 24) == [200] * 24
    pg = Playground("--router-url", f"http://{router.addr}")
    fleet_procs.append(pg)
    page, errors = open_page(browser, pg.url + "#fleet")
    expect = router.requests_per_worker()
    page.wait_for_function(
        f"(window.playground.last.fleet?.workers || []).reduce((s, w) => s + w.requests, 0) == {sum(expect.values())}",
        timeout=30_000,
    )
    snap = page.evaluate("window.playground.last.fleet")
    assert {w["url"]: w["requests"] for w in snap["workers"]} == expect
    for w in snap["workers"]:
        row = f"#fleet-table tr[data-url='{w['url']}']"
        assert page.inner_text(f"{row} .requests") == str(expect[w["url"]])
        assert 0 < w["hit_rate"] <= 1  # each worker's own prefix cache, from its /metrics
        assert page.inner_text(f"{row} .hit") == f"{100 * w['hit_rate']:.1f}%"
    # what each holds: the blocks the KV-events worker announced, as its own /metrics counts
    # them; for the other, the router's tree for it
    plain, events = workers
    blocks = re.search(r"^radixserve_kv_events_blocks (\S+)$", get(events.url, "/metrics"), re.M)
    assert blocks and float(blocks.group(1)) > 0
    holds = f"#fleet-table tr[data-url='{events.url}'] .holds"
    assert page.inner_text(holds) == f"{float(blocks.group(1)):g} blocks"
    units = re.search(
        rf'tree_size_units{{worker="{plain.url}"}} (\d+)', get(router.addr, "/metrics")
    )
    assert units and int(units.group(1)) > 0
    assert page.inner_text(f"#fleet-table tr[data-url='{plain.url}'] .holds") == (
        f"{units.group(1)} units"
    )
    # more traffic: the page refreshes itself, no reload
    assert send(router.addr, 12) == [200] * 12
    total = sum(router.requests_per_worker().values())
    page.wait_for_function(
        f"[...document.querySelectorAll('#fleet-table .requests')].reduce((s, e) => s + +e.textContent, 0) == {total}",
        timeout=30_000,
    )
    # the per-second history counted every request routed since the page's first snapshot
    latest = page.evaluate("Object.values(window.playground.fleetHistory.prev.requests)")
    assert sum(latest) == total
    page.wait_for_function(
        f"Object.values(window.playground.fleetHistory.workers).flatMap(s => s.delta).reduce((a, b) => a + b, 0) == {total - sum(expect.values())}",
        timeout=30_000,
    )
    # the screenshot under load, where the page gets to see some (nothing is asserted on it)
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(lambda: asyncio.run(load(router.addr, 48, 8)))
        try:
            page.wait_for_function(
                "window.playground.last.fleet.workers.some(w => w.load > 0)", timeout=5_000
            )
        except sync_api.TimeoutError:
            pass
        page.screenshot(path=str(shots / "playground-fleet.png"), full_page=True)
        assert busy.result() == [200] * 48
    router.kill()  # the router gone: the page says so and keeps going
    page.wait_for_selector("#fleet-error:not([hidden])", timeout=30_000)
    assert "did not answer" in page.inner_text("#fleet-error")
    assert errors == []
    page.close()


def test_settings_the_api_refuses_show_its_message(browser, playground):
    page, errors = open_page(browser, playground.url)
    wait_done(page)
    done = page.evaluate("window.playground.done")
    page.focus("#system_prompt_len")
    page.keyboard.press("End")  # 2048-token prompts in a 1,200-token KV pool
    wait_done(page, done)
    message = page.inner_text("#error")
    assert page.is_visible("#error") and message.startswith("kv_tokens=1200 cannot hold one")
    # the last numbers the API gave stay up, for the settings before
    assert page.locator("#compare-table tbody tr").count() == 2
    page.focus("#kv_tokens")
    page.keyboard.press("End")  # 20,000 tokens: it fits again, the error goes
    page.wait_for_selector("#error", state="hidden", timeout=60_000)
    wait_done(page, done + 1)
    assert page.evaluate("window.playground.last.compare.params.kv_tokens") == 20000
    assert errors == []
    page.close()
