"""`pagedq dashboard` in a real browser (Debian's chromium through chromium-driver and selenium): the page loads,
its numbers are Redis', a prompt submitted in its form streams its tokens into the page. Plus the app mounted
under a prefix, as `pagedq serve` mounts it."""

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from bench.harness import Process
from producer import Client
from producer.keys import Keys
from worker.redis_server import free_port

FLAGS = ("--max-num-seqs", "4", "--num-kv-blocks", "64", "--max-model-len", "256", "--heartbeat-s", "0.5")
SCREENSHOT_ENV = "PAGEDQ_DASHBOARD_SCREENSHOT"  # where to keep the screenshot (docs/dashboard.png is made so)


def wait_for(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while True:
        try:
            got = cond()
        except Exception:  # an element not there yet, a page mid-render
            got = None
        if got:
            return got
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


def _browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the dev extra has it)")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None)
    if not chromium or not driver:
        pytest.skip("chromium and chromium-driver are not installed (Debian: apt-get install chromium "
                    "chromium-driver; .ci/run does)")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1300"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=driver), options=opts)


@pytest.fixture
def browser():
    b = _browser()
    yield b
    b.quit()


@pytest.fixture
def dashboard(redis_url, tmp_path):
    procs = []

    def start(queue: str) -> str:
        port = free_port()
        p = Process([sys.executable, "-m", "cli", "dashboard", "--redis-url", redis_url, "--queue", queue,
                     "--port", str(port)], tmp_path / "dashboard.log", name="the dashboard")
        procs.append(p)
        base = f"http://127.0.0.1:{port}/"
        p.wait_healthy(base + "api/state", timeout=60)
        return base

    yield start
    for p in procs:
        if p.stop(10) not in (0, -15):
            print(f"dashboard exited with {p.returncode}:\n{p.tail()}")


def cells(browser, selector: str) -> dict[str, str]:
    """The cells of a table row, by field. The page redraws its tables every refresh: a row replaced while it
    is read is read again."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    for _ in range(10):
        try:
            row = browser.find_element(By.CSS_SELECTOR, selector)
            return {td.get_attribute("data-f"): td.text for td in row.find_elements(By.CSS_SELECTOR, "td")}
        except StaleElementReferenceException:
            continue
    raise AssertionError(f"the row {selector} was redrawn on every read")


def test_dashboard_in_chromium(redis_url, queue, rds, pq_tiny_model, start_worker, dashboard, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    backlog = queue + "-backlog"  # no worker: its jobs stay put, so its numbers hold still to compare
    start_worker(queue, pq_tiny_model, *FLAGS, "--worker-id", "dash-w1")
    with Client(redis_url, queue=backlog) as c:
        c.submit_many([{"prompt": f"later {i}", "max_tokens": 4} for i in range(3)])
        c.submit_many([{"prompt": f"batch {i}", "max_tokens": 4, "lane": "batch", "group": "acme"} for i in range(2)])
    rds.xadd(Keys(backlog).dlq, {"id": "dead-1", "error": "worker_error", "reason": "it crashed its worker 3 times",
                                 "attempts": 3, "worker": "w0", "at": f"{time.time():.3f}", "job": "{}"})
    with Client(redis_url, queue=queue) as c:  # some history for the charts
        for j in c.submit_many([{"prompt": f"warm {i}", "max_tokens": 6, "temperature": 0} for i in range(3)]):
            assert j.result(timeout=120).status == "completed"

    browser.get(dashboard(backlog))
    wait_for(lambda: browser.find_element(By.CSS_SELECTOR, 'tr[data-worker="dash-w1"]'), 60, "the worker's row")

    # The numbers are Redis'.
    k = Keys(backlog)
    row = cells(browser, f'#queues tr[data-queue="{backlog}"]')
    assert row["length"] == str(rds.xlen(k.jobs) + rds.xlen(k.stream("batch", "acme"))) == "5"
    assert row["waiting"] == "5" and row["pending"] == "0" and row["dead_letters"] == str(rds.xlen(k.dlq)) == "1"
    # Per lane, and per group inside one.
    assert cells(browser, f'#lanes tr[data-queue="{backlog}"][data-lane="default"]')["waiting"] == "3"
    assert cells(browser, f'#lanes tr[data-queue="{backlog}"][data-lane="batch"][data-group="acme"]')["length"] == "2"
    assert cells(browser, f'#queues tr[data-queue="{queue}"]')["workers"] == "1"
    record = json.loads(rds.get(Keys(queue).worker("dash-w1")))
    w = cells(browser, 'tr[data-worker="dash-w1"]')
    assert w["model"] == record["model"] and w["device"] == "cpu/float32"
    assert w["batch"].endswith("/4") and w["kv"].split(" ")[0].endswith(f"/{record['kv_blocks_total']}")
    dead = cells(browser, 'tr[data-job="dead-1"]')
    assert dead["reason"] == "it crashed its worker 3 times" and dead["error"] == "worker_error"

    # The charts: the warm-up jobs' tokens reach the throughput chart from the workers' stats.
    wait_for(lambda: browser.find_element(By.CSS_SELECTOR, '#chart-throughput path[data-series="tokens_per_s"]'),
             60, "the throughput line")
    wait_for(lambda: float(browser.find_element(By.TAG_NAME, "body").get_attribute("data-tokens") or 0) >= 18, 60,
             "the warm-up tokens in the charts")
    assert browser.find_elements(By.CSS_SELECTOR, '#chart-ttft path[data-series="p50"]')

    # A prompt through the form: its tokens stream into the page, and they are the job's.
    Select(browser.find_element(By.ID, "queue")).select_by_value(queue)
    browser.find_element(By.ID, "chat").click()  # the tiny model has no chat template: a plain prompt
    prompt = browser.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys("Tell me about queues")
    box = browser.find_element(By.ID, "max-tokens")
    box.clear()
    box.send_keys("12")
    browser.find_element(By.ID, "submit").click()
    wait_for(lambda: browser.find_element(By.ID, "job-status").text.startswith("done"), 120, "the job to finish")
    job_id = browser.find_element(By.ID, "job-id").text
    with Client(redis_url, queue=queue) as c:
        res = c.result(job_id, timeout=10)
    assert res.status == "completed" and res.text
    assert browser.find_element(By.ID, "output").get_attribute("textContent") == res.text
    assert browser.find_element(By.ID, "job-status").text == f"done ({res.usage.completion_tokens} tokens)"

    browser.save_screenshot(str(tmp_path / "dashboard.png"))
    if os.environ.get(SCREENSHOT_ENV):
        shutil.copy(tmp_path / "dashboard.png", os.environ[SCREENSHOT_ENV])


def test_dashboard_mounts_under_a_prefix(redis_url, queue):
    starlette = pytest.importorskip("starlette", reason="the dashboard needs the serve extra")
    from starlette.applications import Starlette
    from starlette.routing import Mount
    from starlette.testclient import TestClient

    from monitor.dashboard import create_app

    assert starlette
    outer = Starlette(routes=[Mount("/dashboard", create_app(redis_url, queue))])
    with TestClient(outer) as client:
        page = client.get("/dashboard")  # redirected to /dashboard/, so the page's relative URLs resolve
        assert page.status_code == 200 and "<title>pagedq dashboard</title>" in page.text
        assert str(page.url).endswith("/dashboard/")
        state = client.get("/dashboard/api/state").json()
        assert state["queues"][0]["queue"] == queue
        bad = client.post("/dashboard/api/submit", json={"prompt": "x", "max_tokens": 0})
        assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]
        ok = client.post("/dashboard/api/submit", json={"prompt": "x", "max_tokens": 3}).json()
        assert ok["queue"] == queue
    with Client(redis_url, queue=queue) as c:
        assert c.status(ok["id"]) == "queued"
