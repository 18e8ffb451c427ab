"""`asyncengine plugins port`: the rewrites at exact positions, what it cannot map (file:line and the docs
section), dry run by default, on vLLM-shaped sources and distributions written here."""

from __future__ import annotations

import shutil
from pathlib import Path

from asyncengine.porting.codemod import port_config_text, port_python
from support.vllm_shaped import PLUGINS, port

SOURCE = '''"""Plugin. é"""  # a non-ASCII character before the imports: columns are UTF-8 bytes in ast
import os
from vllm import LLM, ModelRegistry as Registry, SamplingParams
import vllm.envs as envs
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.v1.core.sched.scheduler import Scheduler as Base, SchedulerOutput

if True:
    from vllm.config import VllmConfig


def paths():
    os.environ["VLLM_PLUGINS"] = "x"  # é
    return ["vllm.v1.worker.gpu_worker.Worker", 'vllm.worker.multi_step_worker.MultiStepWorker', envs.VLLM_USE_V1,
            envs.VLLM_ATTENTION_BACKEND]
'''

EXPECTED = '''"""Plugin. é"""  # a non-ASCII character before the imports: columns are UTF-8 bytes in ast
import os
from asyncengine import LLM, SamplingParams
from asyncengine.plugins_api import ModelRegistry as Registry
from asyncengine.plugins_api import envs
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from asyncengine.plugins_api import Scheduler as Base
from vllm.v1.core.sched.scheduler import SchedulerOutput

if True:
    from asyncengine.plugins_api import VllmConfig


def paths():
    os.environ["ASYNCENGINE_PLUGINS"] = "x"  # é
    return ["asyncengine.worker.worker:Worker", 'vllm.worker.multi_step_worker.MultiStepWorker', envs.VLLM_USE_V1,
            envs.VLLM_ATTENTION_BACKEND]
'''


def test_python_rewrites_keep_everything_else_and_list_what_cannot_be_mapped():
    result = port_python(SOURCE)
    assert result.text == EXPECTED
    assert [(r.line, r.new) for r in result.rewrites][:2] == [
        (3, "from asyncengine import LLM, SamplingParams\nfrom asyncengine.plugins_api import ModelRegistry as Registry"),
        (4, "from asyncengine.plugins_api import envs")]
    unmapped = [(u.line, u.what, u.section) for u in result.unmapped]
    assert unmapped == [
        (5, "vllm.model_executor.layers.mamba.mamba_mixer2.MambaMixer2", "custom-ops"),
        (6, "vllm.v1.core.sched.scheduler.SchedulerOutput", "the-table-of-names"),
        (14, "the class path 'vllm.worker.multi_step_worker.MultiStepWorker'", "the-table-of-names"),
        (15, "envs.VLLM_ATTENTION_BACKEND", "environment-variables"),
    ]
    assert port_python(result.text).rewrites == []  # ported once: nothing left to rewrite


def test_entry_point_groups_in_pyproject_and_setup_cfg():
    pyproject = '[project]\ndependencies = ["vllm>=0.10"]\n\n[project.entry-points."vllm.general_plugins"]\n' \
                'a = "pkg:register"\n\n[project.entry-points."vllm.endpoint_plugins"]\nb = "pkg:B"\n'
    result = port_config_text(pyproject)
    assert '[project.entry-points."asyncengine.general_plugins"]' in result.text
    assert '[project.entry-points."asyncengine.endpoint_plugins"]' in result.text
    assert [r.line for r in result.rewrites] == [4, 7]
    assert [(u.line, u.section) for u in result.unmapped] == [(2, "dependencies")]
    cfg = port_config_text("[options.entry_points]\nvllm.platform_plugins =\n    p = pkg:detect\n")
    assert cfg.text == "[options.entry_points]\nasyncengine.platform_plugins =\n    p = pkg:detect\n"


def test_the_command_is_a_dry_run_unless_told_to_write(tmp_path):
    source = tmp_path / "vllm-shaped-endpoint"
    shutil.copytree(PLUGINS / "vllm-shaped-endpoint", source)
    # A module reaching into vLLM's server, which is no interface here: listed, not rewritten.
    (source / "vllm_shaped_endpoint" / "internals.py").write_text(
        "from vllm.entrypoints.openai.api_server import build_app  # noqa: F401\n")
    before = {path: path.read_text() for path in source.rglob("*") if path.is_file()}
    dry = port(source, write=False)
    assert dry.returncode == 1  # some uses cannot be mapped
    assert {path: path.read_text() for path in before} == before
    lines = dry.stdout.splitlines()
    assert "setup.cfg:12: rewrite: vllm.endpoint_plugins =  ->  asyncengine.endpoint_plugins =" in lines
    assert any(line.startswith("vllm_shaped_endpoint/internals.py:1: cannot map vllm.entrypoints.openai.api_server"
                               ".build_app") and line.endswith("(see docs/porting.md#endpoint-plugins)")
               for line in lines), dry.stdout
    assert 'vllm_shaped_endpoint/__init__.py:23: rewrite: "VLLM_PLUGINS"  ->  "ASYNCENGINE_PLUGINS"' in lines
    assert not any("attach_router" in line for line in lines)  # vLLM's endpoint form is served as it is
    assert lines[-1] == ("2 rewrite(s) in 2 file(s), dry run, nothing written (--write applies them); "
                         "uses of vLLM names: 2 mapped, 0 provided by name, 1 use(s) cannot be mapped")
    written = port(source, write=True)
    assert written.returncode == 1
    assert "asyncengine.endpoint_plugins =" in (source / "setup.cfg").read_text()
    module = source / "vllm_shaped_endpoint" / "__init__.py"
    assert module.read_text() == before[module].replace('"VLLM_PLUGINS"', '"ASYNCENGINE_PLUGINS"')


def test_vllms_attention_impl_forward_is_listed_with_what_to_change():
    source = ("class Impl:\n"
              "    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):\n"
              "        return output\n")
    (unmapped,) = port_python(source).unmapped
    assert (unmapped.line, unmapped.section) == (2, "attention-backends")
    assert "forward(query, key, value, kv_cache, metadata)" in unmapped.hint


def test_a_missing_path_is_a_usage_error(tmp_path):
    assert port(tmp_path / "nope", write=False).returncode == 2


def test_the_docs_table_is_the_table_the_tool_applies_and_every_section_it_names_exists():
    import re

    from asyncengine.porting import table

    page = (Path(__file__).resolve().parents[2] / "docs" / "porting.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| ([a-z -]+) \| `([^`]+)` \| `([^`]+)` \|", page, flags=re.M)
    assert rows == table.rename_rows()
    slugs = {re.sub(r"[^a-z0-9 -]", "", heading.lower()).replace(" ", "-")
             for heading in re.findall(r"^#+ (.+)$", page, flags=re.M)}
    named = {section for _, section, _ in table.UNMAPPED} | {"custom-ops", "environment-variables", "dependencies",
                                                                "endpoint-plugins", "not-here-yet", "the-port-tool"}
    assert named <= slugs, named - slugs


BARE_SOURCE = '''import os, vllm
import vllm.envs
import vllm.model_executor.models as models
import vllm.v1.core.sched.scheduler as sched


def used():  # é: columns are UTF-8 bytes
    return (vllm.SamplingParams(max_tokens=2).max_tokens, vllm.envs.VLLM_USE_V1, models.ModelRegistry,
            sched.Scheduler, os.sep)


def unmapped():
    return models.opt.OPTForCausalLM
'''

BARE_EXPECTED = '''import os
import asyncengine.plugins_api

import vllm.model_executor.models as models



def used():  # é: columns are UTF-8 bytes
    return (asyncengine.SamplingParams(max_tokens=2).max_tokens, asyncengine.plugins_api.envs.VLLM_USE_V1, asyncengine.plugins_api.ModelRegistry,
            asyncengine.plugins_api.Scheduler, os.sep)


def unmapped():
    return models.opt.OPTForCausalLM
'''


def test_bare_imports_rewrite_the_mapped_attribute_chains_and_keep_the_import_for_the_rest():
    result = port_python(BARE_SOURCE)
    assert result.text == BARE_EXPECTED
    assert [(r.line, r.old, r.new) for r in result.rewrites] == [
        (1, "import os, vllm", "import os\nimport asyncengine.plugins_api"),
        (2, "import vllm.envs", ""),  # its name's uses were rewritten at line 1's import of it
        (4, "import vllm.v1.core.sched.scheduler as sched", ""),  # imported at line 1 already
        (8, "vllm.SamplingParams", "asyncengine.SamplingParams"),
        (8, "vllm.envs", "asyncengine.plugins_api.envs"),
        (8, "models.ModelRegistry", "asyncengine.plugins_api.ModelRegistry"),
        (9, "sched.Scheduler", "asyncengine.plugins_api.Scheduler"),
    ]
    # `models` keeps its import for the one use the table cannot map, listed with its line and section.
    assert [(u.line, u.what, u.section) for u in result.unmapped] == [
        (13, "vllm.model_executor.models.opt.OPTForCausalLM", "models")]
    assert port_python(result.text).rewrites == []


def test_a_bare_import_whose_uses_all_map_is_replaced_and_the_result_runs_without_vllm():
    source = ("import vllm\nimport vllm.model_executor.models as models\n\n\n"
              "def run():\n    if True: import vllm.envs as unused_alias  # noqa\n"
              "    return vllm.SamplingParams(max_tokens=2).max_tokens, vllm.envs.VLLM_USE_V1, models.ModelRegistry\n")
    result = port_python(source)
    assert result.text == (
        "import asyncengine.plugins_api\n\n\n\n"  # the second import's line stays, empty: later lines keep numbers
        "def run():\n    if True: from asyncengine.plugins_api import envs as unused_alias  # noqa\n"
        "    return asyncengine.SamplingParams(max_tokens=2).max_tokens, asyncengine.plugins_api.envs.VLLM_USE_V1, "
        "asyncengine.plugins_api.ModelRegistry\n")
    assert result.unmapped == []
    namespace: dict = {}
    exec(compile(result.text, "ported", "exec"), namespace)
    from asyncengine import plugins_api

    assert namespace["run"]() == (2, True, plugins_api.ModelRegistry)
    flagged = port_python("import vllm\n\nbackend = vllm.envs.VLLM_ATTENTION_BACKEND\n")
    assert [(u.line, u.what, u.section) for u in flagged.unmapped] == [
        (3, "envs.VLLM_ATTENTION_BACKEND", "environment-variables")]


def test_a_bare_import_with_no_mapped_use_is_left_as_it_was_and_listed():
    source = "import vllm\n\nvllm.distributed.get_world_group()\nimport vllm.unused\n"
    result = port_python(source)
    assert result.text == source
    assert [(u.line, u.what) for u in result.unmapped] == [(3, "vllm.distributed.get_world_group")]
    unused = port_python("import vllm.spare as spare\n")
    assert unused.text == "import vllm.spare as spare\n"
    assert [u.what for u in unused.unmapped] == ["import vllm.spare"]


def test_a_plugins_own_vllm_names_raise_no_alarm_and_vllms_are_named():
    source = ('import logging, os\nimport vllm.envs as e\n\n'
              'OWN = os.environ.get("VLLM_ASCEND_ENABLE_NZ", "0"), os.getenv("VLLM_MY_PLUGIN_CHUNK")\n'
              'LEVEL = e.VLLM_LOGGING_LEVEL\nlogging.getLogger("vllm").addHandler(logging.NullHandler())\n'
              'VLLMS = os.environ.get("VLLM_ATTENTION_BACKEND"), e.VLLM_USE_DEEP_GEMM\n')
    result = port_python(source)
    # vLLM's own variables that asyncengine does not read are named; the plugin's own VLLM_* are its business
    assert sorted((u.line, u.what) for u in result.unmapped) == [
        (7, "envs.VLLM_USE_DEEP_GEMM"), (7, "the environment variable VLLM_ATTENTION_BACKEND")]
    assert 'logging.getLogger("asyncengine")' in result.text and "VLLM_ASCEND_ENABLE_NZ" in result.text
    assert "from asyncengine.plugins_api import envs as e" in result.text


def test_an_unpacked_wheels_registration_is_ported_and_an_egg_infos_copy_is_not(tmp_path):
    from asyncengine.porting.project import port_tree

    wheel_info = tmp_path / "pkg-1.0.dist-info"
    egg_info = tmp_path / "pkg.egg-info"
    for folder in (wheel_info, egg_info):
        folder.mkdir()
        (folder / "entry_points.txt").write_text(
            "[console_scripts]\npkg = pkg:main\n\n[vllm.general_plugins]\npkg = pkg:register\n")
    report = port_tree(tmp_path)
    report.write()
    assert (wheel_info / "entry_points.txt").read_text() == (
        "[console_scripts]\npkg = pkg:main\n\n[asyncengine.general_plugins]\npkg = pkg:register\n")
    assert "[vllm.general_plugins]" in (egg_info / "entry_points.txt").read_text()  # generated from the sources
    assert report.num_mapped == 1 and report.num_unmapped == 0
