"""A real headless browser for tests: Debian's chromium driven by selenium, nothing downloaded at run time.

    def test_page(browser, tmp_path):           # the session-scoped fixture (registered in tests/conftest.py)
        browser.get(path.as_uri())
        assert console_errors(browser) == []
        assert images_rendered(browser)

The fixture needs /usr/bin/chromium, /usr/bin/chromedriver and the selenium package. Without them it
skips the test, or fails it when CI is set to a truthy value (CI=true), so a CI machine that lost its
browser cannot pass silently.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
HOW_TO_ENABLE = "apt-get install -y chromium chromium-driver && .venv/bin/pip install 'selenium>=4.20'"
CHROME_FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
    "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1400,1000",
)


def ci_is_set() -> bool:
    """True when the CI environment variable holds a truthy value (true, 1, yes, on)."""
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}


def missing_parts() -> list[str]:
    """What the browser fixture needs and this machine lacks; [] when it can run."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not (p.is_file() and os.access(p, os.X_OK))]
    if importlib.util.find_spec("selenium") is None:
        missing.append("the selenium package")
    return missing


def start_chrome(user_data_dir: Path):
    """A headless chromium with an explicit driver path
    (so Selenium Manager never runs) and console logs on."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROME_FLAGS, f"--user-data-dir={user_data_dir}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


@pytest.fixture(scope="session")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """A selenium WebDriver on headless chromium, shared by the session; skip (fail under CI) without one."""
    missing = missing_parts()
    if missing:
        message = f"no headless browser: missing {', '.join(missing)}; to enable: {HOW_TO_ENABLE}"
        if ci_is_set():
            pytest.fail(message + " (CI is set: browser tests must run)")
        pytest.skip(message)
    profile = tmp_path_factory.mktemp("chromium-profile")
    driver = start_chrome(profile)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def console_errors(driver) -> list[str]:
    """Console messages at SEVERE level since the last call (reading the log empties it)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def images_rendered(driver) -> bool:
    """True when the page has at least one <img> and every one finished loading with a real width."""
    return driver.execute_script(
        "const imgs = Array.from(document.images);"
        "return imgs.length > 0 && imgs.every(i => i.complete && i.naturalWidth > 0);"
    )
