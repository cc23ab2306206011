"""The live dashboard in headless Chromium: it loads without console errors, shows the numbers
of a known ledger, and updates when a round closes. It serves on a socket and drives a browser,
so it is `network`-marked, outside the default suite (`pytest -m network` runs it). Chromium and
its driver are not installed by the test (on Debian: `apt-get install chromium
chromium-driver`); without them it skips and says why."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from blocktrain.listener import ThreadedServer, bind
from blocktrain.protocol.http.app import create_app
from tests.protocol.conftest import SETTINGS, FakeClock, add_token, auth, delta_body, make_state

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")

pytestmark = pytest.mark.network


def _chromium() -> tuple[str, str]:
    """(browser, driver) paths, or a skip that names what is missing."""
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver is None:
        missing = [
            name for name, path in (("chromium", binary), ("chromedriver", driver)) if not path
        ]
        pytest.skip(
            f"{' and '.join(missing)} not on PATH (apt-get install chromium chromium-driver)"
        )
    return binary, driver


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    binary, driver_path = _chromium()
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1200,1400"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    yield driver
    driver.quit()


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_dashboard_shows_the_ledger_and_updates_live(browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    state = make_state(tmp_path / "state")
    alice = add_token(state, "alice")
    clock = FakeClock()
    app = create_app(storage=state, clock=clock)
    server = ThreadedServer.start(app, bind("127.0.0.1", 0))
    try:
        import httpx

        http = httpx.Client(base_url=server.url)
        service = app.state.service
        worker = http.post("/v1/workers", json={"block": 0}, headers=auth(alice)).json()
        w = worker["worker_id"]
        assert http.get("/v1/blocks/0", headers=auth(alice, w)).status_code == 200
        ok = delta_body(0, worker=w, loss=2.5)
        assert http.post("/v1/blocks/0/updates", content=ok, headers=auth(alice, w)).is_success
        stale = delta_body(0, worker=w, round=7)
        assert http.post("/v1/blocks/0/updates", content=stale, headers=auth(alice, w)).is_error
        clock.advance(31.0)
        service.tick()  # round 0 of block 0 closes: version 1

        browser.get(server.url + "/dashboard")
        box = browser.find_element(By.ID, "token")
        box.send_keys(alice)
        browser.find_element(By.CSS_SELECTOR, "#auth button").click()

        def cells(table: str) -> list[list[str]]:
            # in one script: the page rebuilds its tables on every poll, so element handles
            # taken one by one can go stale between two reads
            return browser.execute_script(
                "return [...document.querySelectorAll(arguments[0])]"
                ".map(r => [...r.cells].map(c => c.textContent))",
                f"#{table} tbody tr",
            )

        wait_for(lambda: len(cells("blocks")) == 2, "the blocks table")
        assert cells("blocks")[0][:3] == ["0", "1", "1"]  # block, version, round
        assert cells("blocks")[0][6] == "100%"  # round 0: 1 of 1 expected replica reported
        assert browser.find_element(By.ID, "accepted").text == "1"
        assert browser.find_element(By.ID, "refused").text == "1"
        (reason,) = cells("reasons")
        assert reason[1] == "1"
        assert cells("workers")[0][:3] == [str(w), "0", "yes"]

        # a second round closes while the page is open: it follows without a reload
        assert http.get("/v1/blocks/0", headers=auth(alice, w)).status_code == 200
        nxt = delta_body(0, worker=w, round=1, base_version=1, loss=2.0)
        assert http.post("/v1/blocks/0/updates", content=nxt, headers=auth(alice, w)).is_success
        clock.advance(31.0)
        service.tick()
        wait_for(lambda: cells("blocks")[0][1] == "2", "version 2 on the page")
        assert browser.find_element(By.ID, "accepted").text == "2"

        screenshot = os.environ.get("BLOCKTRAIN_DASHBOARD_SCREENSHOT")
        if screenshot:  # how docs/dashboard.png is made
            browser.save_screenshot(screenshot)
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
    finally:
        server.stop()
        state.close()


def test_dashboard_marks_workers_that_left_and_a_finished_run(browser, tmp_path: Path) -> None:
    """Issue 30: workers that exited stayed `live yes`, and nothing said the run was done. A
    token in the URL's fragment (`/dashboard#token=...`, as `blocktrain cluster` prints it)
    opens the page without pasting, and leaves the address bar."""
    from selenium.webdriver.common.by import By

    state = make_state(tmp_path / "state", SETTINGS.replace(max_rounds=1))
    alice, bob = add_token(state, "alice"), add_token(state, "bob")
    clock = FakeClock()
    app = create_app(storage=state, clock=clock)
    server = ThreadedServer.start(app, bind("127.0.0.1", 0))
    try:
        import httpx

        http = httpx.Client(base_url=server.url)
        ids = {}
        for b, token in ((0, alice), (1, bob)):
            w = http.post("/v1/workers", json={"block": b}, headers=auth(token)).json()
            ids[b] = w["worker_id"]
            assert http.get(f"/v1/blocks/{b}", headers=auth(token, ids[b])).status_code == 200
            body = delta_body(b, worker=ids[b])
            r = http.post(f"/v1/blocks/{b}/updates", content=body, headers=auth(token, ids[b]))
            assert r.is_success, r.text
        clock.advance(3.0)
        assert http.delete(f"/v1/workers/{ids[0]}", headers=auth(alice, ids[0])).is_success

        browser.execute_script("sessionStorage.clear()")
        browser.get(server.url + "/dashboard#token=" + alice)

        def cells(table: str) -> list[list[str]]:
            return browser.execute_script(
                "return [...document.querySelectorAll(arguments[0])]"
                ".map(r => [...r.cells].map(c => c.textContent))",
                f"#{table} tbody tr",
            )

        wait_for(lambda: len(cells("workers")) == 2, "the workers table")
        assert "#" not in browser.current_url, "the token left the address bar"
        left, live = cells("workers")
        assert left[:3] == [str(ids[0]), "0", "left 0 s ago"]
        assert live[:3] == [str(ids[1]), "1", "yes"]
        assert [row[2] for row in cells("blocks")] == ["1 (done)", "1 (done)"]
        assert browser.find_element(By.ID, "done").text == "done: every block finished its 1 round"
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
    finally:
        server.stop()
        state.close()


def test_dashboard_plots_the_live_validation_ce(browser, tmp_path: Path) -> None:
    """The live evaluation (`--set live_eval_every`, STATE/evals.jsonl) is drawn under the loss
    curve, labelled with its slice and M, its last point named in the legend."""
    state = make_state(tmp_path / "state")
    alice = add_token(state, "alice")
    state.write_evals(
        {"rounds": r, "from_noise_ce": ce, "sampler_ce": ce, "bytes": 4096, "sweeps": 1}
        for r, ce in ((0, 5.5452), (1, 4.25), (2, 3.125))
    )
    app = create_app(storage=state, clock=FakeClock())
    server = ThreadedServer.start(app, bind("127.0.0.1", 0))
    try:
        browser.execute_script("sessionStorage.clear()")
        browser.get(server.url + "/dashboard#token=" + alice)

        def legend() -> list[str]:
            return browser.execute_script(
                "return [...document.querySelectorAll('#evallabels li')].map(li => li.textContent)"
            )

        wait_for(lambda: any("after 2 rounds" in t for t in legend()), "the live CE legend")
        (shown,) = legend()  # M = 1: the sampler CE is the from-noise CE, plotted once
        assert "from-noise CE" in shown and "4096 bytes, M = 1" in shown, shown
        assert shown.endswith(": 3.1250 after 2 rounds"), shown
        svg = browser.execute_script("return document.getElementById('evals').dataset.last")
        assert svg == "3.1250"
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
    finally:
        server.stop()
        state.close()
