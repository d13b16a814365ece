"""The MLflow UI driven as a person does it: headless Chromium (Debian's `chromium`, installed by `make`) through
Playwright (PyPI; its own browser download cannot work here, so `executable_path` names the system's). Used by
the tests of the promotion path (tests/serve/test_webhook.py): an alias added with the UI's own controls on a
model version's page, which is what the rollout follows. On failure a screenshot is saved next to the test's
files and named in the error."""

from __future__ import annotations

import shutil
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"


def browser_missing() -> str | None:
    """Why the UI cannot be driven here (None: it can)."""
    import importlib.util

    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed (pip install playwright; `make` does)"
    if not Path(CHROMIUM).exists() and not shutil.which("chromium"):
        return f"no {CHROMIUM} (apt-get install chromium; `make` does as root)"
    return None


def add_alias_in_ui(tracking_url: str, model: str, version: str, alias: str, screenshots: Path,
                    timeout_s: float = 60, login: tuple[str, str] | None = None) -> None:
    """Log in as `login` (username, password; default the shell's MLFLOW_TRACKING_USERNAME/PASSWORD: the stack's
    admin), open the version's page in the MLflow UI, click the Aliases "Add" control, type `alias`, save, and wait
    until the page shows it. MLflow's basic-auth app asks the browser for the login (HTTP basic auth)."""
    import os

    from playwright.sync_api import sync_playwright

    user, password = login or (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"])
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium"),
                                    args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        context = browser.new_context(viewport={"width": 1400, "height": 900},
                                      http_credentials={"username": user, "password": password})
        page = context.new_page()
        page.set_default_timeout(timeout_s * 1000)
        try:
            # The alias dialog saves under the registered model the page loads (registered-models/get); a save
            # before it has arrived sends name="" and the dialog stays open. (So does one for a model beyond the
            # first 100 by name, in MLflow 3.17: see tests/conftest.py clear_stack_data.)
            with page.expect_response(lambda r: "/registered-models/get" in r.url and r.ok) as registered:
                page.goto(f"{tracking_url.rstrip('/')}/#/models/{model}/versions/{version}", wait_until="load")
            registered.value.finished()
            page.get_by_role("button", name="Add").first.click()  # next to "Aliases:"
            dialog = page.get_by_role("dialog")
            dialog.get_by_text(f"alias for model version {version}").wait_for()
            dialog.locator("input").fill(alias)
            page.keyboard.press("Enter")
            # MLflow's answer to the save decides: a refusal (403 for a login without the permission) fails at once
            # instead of waiting out the dialog, which stays open.
            with page.expect_response(lambda r: "/registered-models/alias" in r.url
                                      and r.request.method in ("POST", "PATCH")) as saved:
                dialog.get_by_role("button", name="Save aliases").click()
            if not saved.value.ok:
                raise RuntimeError(f"MLflow answered the save with HTTP {saved.value.status}")
            dialog.wait_for(state="hidden")
            page.get_by_text(f"@ {alias}").or_(page.get_by_text(alias, exact=True)).first.wait_for()
        except Exception as e:
            screenshots.mkdir(parents=True, exist_ok=True)
            shot = screenshots / f"mlflow-ui-{model}-{version}-{alias}-{user}.png"
            page.screenshot(path=str(shot), full_page=True)
            raise AssertionError(f"the MLflow UI did not take alias {alias!r} for {model}/{version} from {user}: "
                                 f"{e}; screenshot: {shot}") from None
        finally:
            browser.close()
