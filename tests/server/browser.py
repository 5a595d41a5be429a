"""Headless Chromium driven by Selenium, for the tests of the page `vkrt serve` answers at /.

Debian's chromium and chromium-driver packages (tools/setup.sh installs them) give
/usr/bin/chromium and /usr/bin/chromedriver; both paths are passed explicitly, so Selenium
Manager never tries to download a browser or a driver.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHROMIUM = os.environ.get("VKRT_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("VKRT_TEST_CHROMEDRIVER", "/usr/bin/chromedriver")
# Where the browser test writes the page's screenshot for docs/USAGE.md (docs/images/ui.png,
# docs/TESTING.md has the command); unset, nothing is written.
SCREENSHOT_ENV = "VKRT_UI_SCREENSHOT"


def chromium_unavailable_reason() -> str | None:
    """Why the browser tests cannot run here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the selenium package is not installed (pip install -e '.[test]')"
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not (Path(path).is_file() and os.access(path, os.X_OK)) and shutil.which(path) is None:
            return f"{path} not found (apt-get install {package}, or run tools/setup.sh)"
    return None


def start_chromium(width: int = 1360, height: int = 900) -> Any:
    """A headless Chromium webdriver; the caller quits it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--disable-extensions", "--no-first-run", "--disable-background-networking",
                 f"--window-size={width},{height}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_script_timeout(60)
    return driver


def wait_until(driver: Any, condition: Callable[[Any], Any], timeout: float, what: str) -> Any:
    """Selenium's WebDriverWait with a message that says what did not happen. An element the page
    re-rendered between finding and reading it (a streamed reply is redrawn per delta) is stale:
    the condition is asked again, not failed."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05, ignored_exceptions=[StaleElementReferenceException]
                         ).until(condition, message=f"timed out waiting for {what}")
