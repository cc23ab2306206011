"""Make docs/dashboard.png: the aggregator's dashboard over a real run's state folder, in
headless Chromium (Debian's `chromium` and `chromium-driver`, and `selenium`).

    blocktrain cluster --workers 6 --preset tiny --rounds 12 --out /tmp/dash-cluster
    python tools/dashboard_screenshot.py /tmp/dash-cluster/state --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from blocktrain.listener import ThreadedServer, bind
from blocktrain.protocol.http.app import create_app
from blocktrain.protocol.store.storage import StateDir
from blocktrain.protocol.store.tokens import hash_token, new_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("state", type=Path, help="an aggregator state folder (copied, not changed)")
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "state"
        shutil.copytree(args.state, copy)
        state = StateDir(copy)
        token = new_token()
        state.ledger.add_token("screenshot", hash_token(token), time.time())
        server = ThreadedServer.start(create_app(storage=state), bind("127.0.0.1", 0))
        opts = webdriver.ChromeOptions()
        opts.binary_location = shutil.which("chromium") or "chromium"
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1100,1500"):
            opts.add_argument(arg)
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
        try:
            driver.get(server.url + "/dashboard")
            driver.find_element(By.ID, "token").send_keys(token)
            driver.find_element(By.CSS_SELECTOR, "#auth button").click()
            deadline = time.monotonic() + 20
            while not driver.find_elements(By.CSS_SELECTOR, "#curve polyline"):
                if time.monotonic() > deadline:
                    raise SystemExit("the dashboard drew no loss curve")
                time.sleep(0.2)
            time.sleep(0.5)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(args.out))
        finally:
            driver.quit()
            server.stop()
            state.close()
    print(args.out)


if __name__ == "__main__":
    main()
