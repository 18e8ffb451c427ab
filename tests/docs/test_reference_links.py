"""The reference (docs/reference.md) has a row for every extension point, and the guide links to it.

- every row id of EXTENSION_POINTS.md (E1-E6, R1-R15, C1-C9, the Platform interface P, the manifest X,
  the five lines G1-G5 of "what goes wrong") has an anchor `<a id="r6"></a>` in reference.md;
- every link to `reference.md#x` (from any page) resolves to such an anchor;
- every page that names an extension point (its row id, or its group, register function or option)
  links to that row;
- every first-party distribution in plugins/ has its section in first-party-plugins.md, naming its
  entry points.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from doc_blocks import DOCS_DIR, REPO_ROOT, guide_pages

REFERENCE = DOCS_DIR / "reference.md"
ROW_IDS = ([f"E{i}" for i in range(1, 7)] + [f"R{i}" for i in range(1, 16)] + [f"C{i}" for i in range(1, 10)]
           + ["P", "X"] + [f"G{i}" for i in range(1, 6)])
# What names a row on a page besides its id: its group, register function or option (as they are written
# in this guide). A page that writes one of these must link to the row.
NAMES = {
    "E1": ["asyncengine.general_plugins"],
    "E2": ["asyncengine.platform_plugins", "platform plugin"],
    "E3": ["asyncengine.io_processor_plugins", "IOProcessor", "--io-processor-plugin"],
    "E4": ["asyncengine.stat_logger_plugins", "StatLoggerBase"],
    "E5": ["asyncengine.endpoint_plugins", "EndpointPlugin"],
    "E6": ["asyncengine.logits_processors"],
    "R1": ["register_model("],
    "R2": ["register_oot", "register_op_impl", "CustomOp"],
    "R3": ["register_attention_backend", "--attention-backend"],
    "R4": ["register_quantization_config", "QuantizationConfig", "--quantization"],
    "R5": ["register_model_loader", "--load-format"],
    "R6": ["register_connector", "KVConnectorFactory", "kv_transfer_config"],
    "R7": ["ToolParserManager", "--tool-parser-plugin", "--tool-call-parser"],
    "R8": ["ReasoningParserManager", "--reasoning-parser"],
    "R9": ["TokenizerRegistry", "--tokenizer-mode"],
    "R10": ["register_structured_output_backend", "--structured-outputs-config"],
    "R11": ["LoRAResolverRegistry", "register_resolver"],
    "R12": ["register_pooler", "PoolerRegistry"],
    "R13": ["register_proposer", "ProposerRegistry"],
    "R14": ["MULTIMODAL_REGISTRY", "register_processor"],
    "R15": ["fused_moe", "FusedMoE"],
    "C1": ["scheduler_cls", "--scheduler-cls"],
    "C2": ["worker_cls", "--worker-cls"],
    "C3": ["worker_extension_cls", "--worker-extension-cls"],
    "C4": ["--logits-processors"],
    "C5": ["model_class_overrides"],
    "C6": ["kv_connector_module_path"],
    "C7": ["distributed_executor_backend", "--distributed-executor-backend"],
    "C8": ["--middleware"],
    "C9": ["additional_config", "hf_overrides"],
    "P": ["Platform interface"],
    "X": ["manifest check"],
}
# The reference itself. (extension-map.md is generated, and its generator links each entry to its row.)
EXEMPT = {"reference.md"}
_ANCHOR = re.compile(r'<a id="([^"]+)"></a>')
_LINK = re.compile(r"\]\(([^)\s]*?)reference\.md#([^)\s]+)\)")
_ROW_ID = re.compile(r"(?<![\w.#/-])(E[1-6]|R1[0-35]|R[1-9]|C[1-9]|G[1-5])(?![\w/])")


def _anchors() -> set[str]:
    return set(_ANCHOR.findall(REFERENCE.read_text(encoding="utf-8")))


def _pages() -> list[Path]:
    return [p for p in guide_pages() if p.parent == DOCS_DIR and p.name not in EXEMPT]


def test_every_row_has_an_anchor() -> None:
    anchors = _anchors()
    missing = [row for row in ROW_IDS if row.lower() not in anchors]
    assert not missing, f"docs/reference.md has no row anchor (<a id=\"..\"></a>) for {missing}"
    unknown = sorted(anchors - {row.lower() for row in ROW_IDS})
    assert not unknown, f"docs/reference.md has anchors that are no row of EXTENSION_POINTS.md: {unknown}"


def test_extension_points_file_has_no_other_rows() -> None:
    """The rows this test knows are those of the planning document, when it is at hand."""
    source = REPO_ROOT.parent / "shared" / "EXTENSION_POINTS.md"
    if not source.exists():
        pytest.skip("../shared/EXTENSION_POINTS.md is not next to this checkout")
    rows = set(re.findall(r"^\| ([ERC]\d+) \|", source.read_text(encoding="utf-8"), re.M))
    # New rows whose issues have not added them yet (EXTENSION_POINTS.md says so): R13 speculative proposers,
    # R14 multimodal processors. The issue that builds a row takes it out of this set (issue 35 took R15, issue 37 R13, issue 38 R14).
    not_built: set[str] = {"R13", "R14"} - {r for r in ROW_IDS}
    assert rows - not_built == {r for r in ROW_IDS if r[0] in "ERC"}, f"rows of EXTENSION_POINTS.md: {sorted(rows)}"


@pytest.mark.parametrize("page", guide_pages(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_links_to_the_reference_resolve(page: Path) -> None:
    anchors = _anchors()
    text = page.read_text(encoding="utf-8")
    broken = [f"reference.md#{anchor}" for prefix, anchor in _LINK.findall(text) if anchor not in anchors]
    assert not broken, f"{page.name} links to reference rows that do not exist: {broken}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_pages_naming_an_extension_point_link_to_its_row(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    linked = {anchor for _, anchor in _LINK.findall(text)}
    named: dict[str, str] = {}
    for row in _ROW_ID.findall(text):
        named.setdefault(row, f"the row id {row}")
    for row, names in NAMES.items():
        for name in names:
            if name in text:
                named.setdefault(row, f"`{name}`")
    missing = [f"{row} (named as {how}): add [{row}](reference.md#{row.lower()})"
               for row, how in sorted(named.items()) if row.lower() not in linked]
    assert not missing, f"docs/{page.name} names extension points without linking to their row:\n" + "\n".join(missing)


def test_every_first_party_plugin_has_its_section() -> None:
    catalog = (DOCS_DIR / "first-party-plugins.md").read_text(encoding="utf-8")
    sections = dict(re.findall(r"^## (\S+)\n(.*?)(?=^## |\Z)", catalog, re.M | re.S))
    problems = []
    for pyproject in sorted((REPO_ROOT / "plugins").glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
        name = project["name"]
        if name not in sections:
            problems.append(f"{name}: no section `## {name}`")
            continue
        for group in project.get("entry-points", {}).values():
            problems += [f"{name}: its entry point `{ep}` is not named in its section"
                         for ep in group if f"`{ep}`" not in sections[name]]
    assert not problems, "docs/first-party-plugins.md is behind plugins/:\n" + "\n".join(problems)
