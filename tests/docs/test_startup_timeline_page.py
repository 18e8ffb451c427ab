"""The interactive start-up timeline page (docs/startup-timeline.md), driven in headless Chromium.

The site is built with mkdocs and served over HTTP from a thread; Chromium (Debian's `chromium` and
`chromium-driver`, which `make test` installs) opens the page, and the test sets the form as a reader
would: mode, tensor-parallel size, device, allow-list, installed plugins (ticking a first-party
distribution, or typing the entry points of a test distribution). For each sampled setting it reads
what the page rendered (processes, phases, details, Platform hooks, trace subjects; the text view; the
command line it shows) and compares it with `asyncengine plugins timeline` run as a subprocess with
the same settings and those plugin distributions really installed (on PYTHONPATH, `plugin_env`).

Chromium missing is a failure, not a skip: the page is a deliverable, and an unchecked page is how it
would drift from the command.
"""

from __future__ import annotations

import functools
import http.server
import json
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE_URL = "startup-timeline/"
GROUPS = ("asyncengine.general_plugins", "asyncengine.platform_plugins", "asyncengine.io_processor_plugins",
          "asyncengine.stat_logger_plugins", "asyncengine.endpoint_plugins", "asyncengine.logits_processors")


def _needed(program: str) -> str:
    found = shutil.which(program)
    if found is None:
        pytest.fail(f"{program} is not installed: the start-up timeline page is tested in headless Chromium. "
                    "`make test` installs Debian's chromium and chromium-driver (apt-get install chromium "
                    "chromium-driver); install them, then run the tests again")
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The docs site, built with the repository's mkdocs.yml and served over HTTP on a free port."""
    config = REPO / "mkdocs.yml"
    if not config.is_file():
        pytest.fail(f"{config} is missing: the docs site (and this page in it) is built from it")
    built = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--quiet", "-f", str(config), "-d", str(built)],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, f"mkdocs build failed:\n{result.stderr}"
    handler = functools.partial(_QuietHandler, directory=str(built))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="docs-site", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass  # one line per request on stderr would bury the test's own output


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = _needed("chromium")
    # --no-sandbox: the tests may run as root (a container), where Chromium's sandbox refuses to start.
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1280,1600"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=_needed("chromedriver")))
    try:
        yield driver
    finally:
        driver.quit()


@dataclass
class Setting:
    """One sampled setting: what a reader chooses on the page, and the distributions really installed."""

    in_process: bool = False
    tp: int = 1
    device: str = "auto"
    allow_list: str | None = None  # None: unset
    ticked: list[str] = field(default_factory=list)  # first-party distributions ticked on the page
    typed: list[str] = field(default_factory=list)  # test distributions whose entry points are typed in
    # also compare the page's text view with the command's plain output (one CLI run more: a few settings do)
    compare_text: bool = False

    def cli_args(self) -> list[str]:
        args = ["plugins", "timeline"]
        if self.in_process:
            args.append("--in-process")
        if self.tp != 1:
            args += ["--tp", str(self.tp)]
        if self.device != "auto":
            args += ["--device", self.device]
        if self.allow_list is not None:
            args += ["--plugins", self.allow_list]
        return args


def entry_points_of(target: Path) -> list[tuple[str, str]]:
    """(name, group) of the asyncengine entry points the distribution installed in `target` declares."""
    found = []
    for dist in metadata.distributions(path=[str(target)]):
        found += [(ep.name, ep.group) for ep in dist.entry_points if ep.group in GROUPS]
    assert found, f"no asyncengine entry points in {target}"
    return found


def _in_view(driver, element):
    """The element in the middle of the window (the theme's fixed header would take a click at its top)."""
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
    return element


def _toggle(driver, box) -> None:
    """Tick or untick a checkbox, or choose a radio button, from the keyboard (space), as a reader may:
    a mouse click lands wherever the theme's layout puts the box at that moment."""
    from selenium.webdriver.common.keys import Keys

    _in_view(driver, box).send_keys(Keys.SPACE)


def fill_form(driver, setting: Setting, plugin_target) -> None:
    from selenium.webdriver.common.by import By

    def field(element_id: str):
        return _in_view(driver, driver.find_element(By.ID, element_id))

    mode = field("ae-mode-in-process" if setting.in_process else "ae-mode-multiprocess")
    if not mode.is_selected():
        _toggle(driver, mode)
    for field_id, value in (("ae-tp", str(setting.tp)), ("ae-device", setting.device)):
        box = field(field_id)
        box.clear()
        box.send_keys(value)
    allow_set = field("ae-allow-set")
    if allow_set.is_selected() != (setting.allow_list is not None):
        _toggle(driver, allow_set)
    if setting.allow_list is not None:
        allow = field("ae-allow")
        allow.clear()
        allow.send_keys(setting.allow_list)
    for box in driver.find_elements(By.CSS_SELECTOR, "input.ae-sample"):
        if box.is_selected() != (box.get_attribute("data-distribution") in setting.ticked):
            _toggle(driver, box)
    ticked = {box.get_attribute("data-distribution") for box in driver.find_elements(By.CSS_SELECTOR,
                                                                                    "input.ae-sample")
              if box.is_selected()}
    assert (mode.is_selected(), allow_set.is_selected(), ticked) == (True, setting.allow_list is not None,
                                                                     set(setting.ticked)), "the form did not take it"
    typed = field("ae-typed")
    typed.clear()
    lines = [f"{name} {group}" for dist in setting.typed for name, group in entry_points_of(plugin_target(dist))]
    typed.send_keys("\n".join(lines))


# Reads the rendered plan back from the page's elements (what a reader sees), not from its script's data.
READ_PAGE = """
const root = document.getElementById("ae-timeline");
const texts = (node, selector) => Array.from(node.querySelectorAll(selector), e => e.textContent);
return {
  state: root.dataset.state,
  error: root.querySelector("#ae-error").hidden ? null : root.querySelector("#ae-error").textContent,
  command: root.querySelector("#ae-command").textContent,
  text: root.querySelector("#ae-text").textContent,
  processes: Array.from(root.querySelectorAll("section.ae-process"), section => ({
    role: section.querySelector(".ae-role").textContent,
    where: section.querySelector(".ae-where").textContent,
    plays: section.querySelector(".ae-plays").textContent,
    phases: Array.from(section.querySelectorAll("li.ae-phase"), phase => ({
      name: phase.querySelector(".ae-phase-name").textContent,
      details: texts(phase, "li.ae-detail"),
      platform_hooks: texts(phase, "code.ae-hook"),
      subjects: texts(phase, "code.ae-subject"),
    })),
  })),
};
"""

SETTINGS = {
    "in-process, one rank, cpu, no plugins": Setting(in_process=True, device="cpu"),
    # the platform plugin's detector in the frontend; the endpoint plugin skipped (opt-in) with the list unset
    "multiprocess, tp 2, a platform and a general distribution": Setting(
        tp=2, typed=["ae-plugin-platform-a", "ae-plugin-general"], compare_text=True),
    "an allow-list that skips some (names trimmed)": Setting(
        allow_list=" ae_general , cpu_a", typed=["ae-plugin-platform-a", "ae-plugin-general"]),
    "the empty allow-list: every plugin skipped": Setting(tp=2, device="cpu", allow_list="",
                                                        typed=["ae-plugin-general"]),
    # an endpoint plugin loads once named; in-process with 3 ranks: worker processes, no engine-core process
    "in-process, tp 3, ticked first-party distributions, the endpoint named": Setting(
        in_process=True, tp=3, device="cpu_example",
        allow_list="ae_example_stats_endpoint,cpu_example,ae_platform_example",
        ticked=["asyncengine-platform-example", "asyncengine-endpoint-example"], compare_text=True),
    "an allow-list naming what is not installed: the configuration error": Setting(
        allow_list="ae_general,not_installed", typed=["ae-plugin-general"]),
}


def test_the_page_shows_what_the_cli_prints_for_each_sampled_setting(site, browser, plugin_env, plugin_target):
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(site + PAGE_URL)
    WebDriverWait(browser, 20).until(lambda d: d.execute_script(
        "return document.getElementById('ae-timeline').dataset.state") in ("rendered", "failed"))
    first = browser.execute_script(READ_PAGE)
    assert first["state"] == "rendered", f"the page did not load its rules: {first['error']}"

    for title, setting in SETTINGS.items():
        env = plugin_env(*setting.ticked, *setting.typed)
        fill_form(browser, setting, plugin_target)
        shown = browser.execute_script(READ_PAGE)
        assert shlex.split(shown["command"]) == ["asyncengine", *setting.cli_args()], title

        as_json = _cli([*setting.cli_args(), "--json"], env)
        if as_json.returncode != 0:
            assert as_json.returncode == 2, (title, as_json.stderr)
            assert shown["error"] == as_json.stderr.strip(), title
            assert shown["processes"] == [] and shown["text"] == "", title
            continue
        assert shown["error"] is None, (title, shown["error"])
        planned = json.loads(as_json.stdout)
        assert [p["role"] for p in shown["processes"]] == [p["role"] for p in planned], title
        for page_process, cli_process in zip(shown["processes"], planned, strict=True):
            assert page_process["plays"] == "plays the roles: " + ", ".join(cli_process["plays"]), title
            assert page_process["where"] == cli_process["where"], title
            assert page_process["phases"] == cli_process["phases"], (title, cli_process["role"])
        if setting.compare_text:
            as_text = _cli(setting.cli_args(), env)
            assert as_text.returncode == 0, (title, as_text.stderr)
            assert shown["text"] == as_text.stdout.rstrip("\n"), title


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncengine", *args], capture_output=True, text=True, env=env,
                          timeout=60)


def test_the_page_lists_the_first_party_distributions_as_they_declare_their_entry_points():
    """Each distribution the page offers to tick has exactly the entry points the page says (its pyproject)."""
    import re

    rules = json.loads((REPO / "docs" / "assets" / "startup-timeline-rules.json").read_text())
    group_keys = {group["entry_point_group"]: group["key"] for group in rules["groups"]}
    page = (REPO / "docs" / "startup-timeline.md").read_text()
    offered = re.findall(r'data-distribution="([^"]+)" data-plugins="([^"]+)"', page)
    assert offered, "the page offers no distribution to tick"
    for distribution, plugins in offered:
        project = tomllib.loads((REPO / "plugins" / distribution / "pyproject.toml").read_text())["project"]
        declared = {f"{name}={group_keys[group]}" for group, points in project.get("entry-points", {}).items()
                    if group in group_keys for name in points}
        assert project["name"] == distribution
        assert set(plugins.split()) == declared, distribution
