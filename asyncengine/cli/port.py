"""`asyncengine plugins port PATH [--write]`: rewrite a vLLM plugin's imports, entry-point groups, class
paths and environment variable names to asyncengine's, and list what cannot be mapped (docs/porting.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from asyncengine.cli.parser import CliParser


def add_parser(commands: argparse._SubParsersAction[CliParser]) -> None:
    port = commands.add_parser(
        "port", help="rewrite a vLLM plugin's names to asyncengine's (a dry run unless --write)",
        description="Rewrite a vLLM plugin's imports (vllm.* -> asyncengine.plugins_api), entry-point groups "
        "(pyproject.toml, setup.py, setup.cfg), dotted class paths and environment variable names. Prints each "
        "rewrite and each use it cannot map (file:line and the docs/porting.md section), then three counts: "
        "uses mapped by the table, uses provided by a name of ours the table has no row for (the import works), "
        "and uses that cannot be mapped. Exit status 1 when some use cannot be mapped.")
    port.add_argument("path", metavar="PATH", help="the plugin's source tree (or one file)")
    port.add_argument("--write", action="store_true", help="write the rewritten files (default: only print)")
    port.set_defaults(handler=run_port)


def run_port(args: argparse.Namespace) -> int:
    from asyncengine.porting.project import port_tree

    root = Path(args.path)
    if not root.exists():
        print(f"asyncengine plugins port: {root} does not exist", file=sys.stderr)
        return 2
    report = port_tree(root)
    for line in report.lines():
        print(line)
    if args.write:
        report.write()
    done = "written" if args.write else "dry run, nothing written (--write applies them)"
    print(f"{report.num_rewrites} rewrite(s) in {len(report.changed)} file(s), {done}; "
          f"uses of vLLM names: {report.num_mapped} mapped, {report.num_provided} provided by name, "
          f"{report.num_unmapped} use(s) cannot be mapped")
    return 1 if report.num_unmapped else 0
