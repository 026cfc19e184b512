"""Help and version: every argument of every command has a help line naming its default, and
--version prints the package's version."""

import argparse
import os
import subprocess
import sys

import edgevl
from edgevl import cli
from support.common import ROOT


def test_every_argument_has_help_with_its_default():
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, sub in subs.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.dest} has no help line"
            takes_value = action.nargs != 0 and not action.required and (action.option_strings or action.nargs == "?")
            shown = cli._Help("edgevl")._get_help_string(action)
            assert not takes_value or "default" in shown, f"{name} {action.dest}: {shown!r}"
    assert "default: bf16" in " ".join(subs["convert"].format_help().split())
    mip = " ".join(subs["run"].format_help().split())
    assert "the model's own" in mip and "max_image_patches" in mip


def test_version():
    r = subprocess.run([sys.executable, "-m", "edgevl.cli", "--version"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0 and r.stdout.strip() == f"edgevl {edgevl.__version__}"
