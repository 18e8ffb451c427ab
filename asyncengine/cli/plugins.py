"""`asyncengine plugins list|timeline|check|map|port`: which process sees which plugin, before and after a start."""

from __future__ import annotations

import argparse
import sys

import anyio

from asyncengine.cli.parser import CliParser
from asyncengine.config.engine import config_from_dict


def add_parser(subparsers: argparse._SubParsersAction[CliParser]) -> None:
    parser = subparsers.add_parser("plugins", help="installed plugins, the start-up timeline, a start-up check")
    commands = parser.add_subparsers(dest="plugins_command", required=True)

    listing = commands.add_parser("list", help="each installed plugin per group: distribution, version, "
                                  "allowed or not, which processes load it")
    _settings(listing, placement=False)
    listing.set_defaults(handler=run_list)

    timeline = commands.add_parser("timeline", help="per process, its start-up phases and what runs in each")
    _settings(timeline, placement=True)
    timeline.add_argument("--trace", metavar="FILE",
                          help="print the records of a real start instead (written by --startup-trace FILE)")
    timeline.add_argument("--json", action="store_true", help="print the plan as JSON")
    timeline.add_argument("--export-rules", metavar="FILE",
                          help="write the rules the plan is computed from as JSON to FILE ('-': print them); the "
                          "docs page startup-timeline.md computes its plan from this file")
    timeline.set_defaults(handler=run_timeline)

    check = commands.add_parser("check", help="start every role without a model and report (exit 1 on a failure)")
    _settings(check, placement=True)
    check.add_argument("--startup-trace", metavar="FILE", help="also write the records as JSON to FILE")
    check.add_argument("--deep", action="store_true",
                       help="also start the workers: init_device, the model built on a tiny dummy-weight Llama "
                       "config and one forward, then stop (docs/porting.md)")
    check.add_argument("--quantization", default=None, metavar="NAME",
                       help="with --deep: build the tiny model's linear layers with this quantization method")
    check.set_defaults(handler=run_check)

    from asyncengine.cli import port

    port.add_parser(commands)

    mapping = commands.add_parser("map", help="per process, every extension point read there and the code that "
                                  "reads it")
    mapping.add_argument("--markdown", action="store_true", help="a table with one column per process (for docs)")
    mapping.add_argument("--write", metavar="FILE", help="write the docs page (docs/extension-map.md) to FILE")
    mapping.set_defaults(handler=run_map)


def _settings(parser: argparse.ArgumentParser, *, placement: bool) -> None:
    parser.add_argument("--plugins", default=None, help="the allow-list (default: ASYNCENGINE_PLUGINS, else all)")
    parser.add_argument("--plugins-lenient", action="store_true", help="record a failed plugin and go on")
    parser.add_argument("--plugin-startup-timeout", type=float, default=60.0, metavar="SECONDS")
    if placement:
        parser.add_argument("--device", default="auto")
        parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
        parser.add_argument("--in-process", action="store_true", help="the engine core in the frontend's process")
        parser.add_argument("--distributed-executor-backend", default=None, metavar="{uni,mp,PKG.MOD:EXECUTOR}")
        # Config hooks: the timeline lists where each is checked; `check` imports and checks them there.
        parser.add_argument("--scheduler-cls", default=None, metavar="PKG.MOD:CLASS")
        parser.add_argument("--worker-extension-cls", default="", metavar="PKG.MOD:CLASS")


def _config(args: argparse.Namespace):
    values = {"plugins": args.plugins, "plugins_lenient": args.plugins_lenient,
              "plugin_startup_timeout": args.plugin_startup_timeout}
    if hasattr(args, "device"):
        values.update(device=args.device, tensor_parallel_size=args.tp, in_process=args.in_process,
                      distributed_executor_backend=args.distributed_executor_backend,
                      scheduler_cls=args.scheduler_cls, worker_extension_cls=args.worker_extension_cls)
    return config_from_dict(values)


def run_list(args: argparse.Namespace) -> int:
    from asyncengine.plugin_runtime.allow_list import AllowList
    from asyncengine.plugin_runtime.discovery import installed_plugins

    installed = installed_plugins()
    allow_list = AllowList.resolve(_config(args).plugins)
    allow_list.check(installed)
    if not installed:
        print("no asyncengine plugins are installed")
        return 0
    print(f"allow-list: {allow_list.as_option() if allow_list.names is not None else 'unset'} ({allow_list.source})")
    for plugin in installed:
        verdict = allow_list.verdict(plugin)
        allowed = "allowed" if verdict is None else f"skipped: {verdict}"
        processes = ", ".join(role for role in ("frontend", "engine core", "worker") if role in plugin.group.roles)
        origin = f"{plugin.distribution} {plugin.version}" if plugin.distribution else "(no distribution)"
        print(f"{plugin.group.entry_point_group}  {plugin.name}  [{origin}]  {allowed}  loaded in: {processes}")
    return 0


def run_timeline(args: argparse.Namespace) -> int:
    if args.export_rules:
        from asyncengine.cli.reports.timeline_rules import rules_json

        text = rules_json()  # independent of the settings and of what is installed
        if args.export_rules == "-":
            sys.stdout.write(text)
        else:
            from pathlib import Path

            Path(args.export_rules).write_text(text)
        return 0
    if args.trace:
        from asyncengine.plugin_runtime.records import format_report, read_trace

        print(format_report(read_trace(args.trace)))
        return 0
    from asyncengine.cli.reports.timeline import format_plan, plan_start

    plans = plan_start(_config(args))
    if args.json:
        import json
        from dataclasses import asdict

        print(json.dumps([asdict(plan) for plan in plans], indent=2))
    else:
        print(format_plan(plans))
    return 0


def run_check(args: argparse.Namespace) -> int:
    if args.deep:
        return _run_deep_check(args)
    if args.quantization is not None:
        print("asyncengine: --quantization is read by the deep check only: add --deep", file=sys.stderr)
        return 2
    from asyncengine.cli.reports.check import check_start
    from asyncengine.plugin_runtime.records import FAILED, format_report, write_trace

    records, error = anyio.run(check_start, _config(args), backend="trio")
    if args.startup_trace:
        write_trace(args.startup_trace, records)
    print(format_report(records))
    if error is not None:
        print(f"asyncengine: check failed: {error}", file=sys.stderr)
        return 1
    failed = [r for r in records if r.outcome == FAILED]
    return 1 if failed else 0


def _run_deep_check(args: argparse.Namespace) -> int:
    import msgspec

    from asyncengine.cli.reports.deep_check import deep_check, format_culprit, unbuilt_quantization_methods
    from asyncengine.plugin_runtime.records import format_report, write_trace

    config = msgspec.structs.replace(_config(args), quantization=args.quantization)
    records, culprit = anyio.run(deep_check, config, backend="trio")
    if args.startup_trace:
        write_trace(args.startup_trace, records)
    print(format_report(records))
    if culprit is not None:
        print(format_culprit(culprit), file=sys.stderr)
        return 1
    unbuilt = unbuilt_quantization_methods(config)
    if unbuilt:
        print(f"not built: the plugins' quantization methods {', '.join(unbuilt)} (check each with --deep "
              "--quantization NAME)")
    print("deep check passed: every rank initialised its device, built the tiny model and ran one forward")
    return 0


def run_map(args: argparse.Namespace) -> int:
    from asyncengine.cli.reports.extension_map import build_map, format_map, format_map_markdown

    entries = build_map()
    if args.write:
        from pathlib import Path

        from asyncengine.cli.reports.extension_map import docs_page

        Path(args.write).write_text(docs_page(entries))
        return 0
    print(format_map_markdown(entries) if args.markdown else format_map(entries))
    return 0
