"""`baton operator`'s entry point and the package's import hygiene."""

from __future__ import annotations

import subprocess
import sys

import pytest
from baton_operator.main import HANDLERS, kopf_args, main

from tests.kube.isvc_helpers import REPO


def test_help_is_kopf_run_under_our_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Usage: baton operator [OPTIONS]")
    for flag in ("--all-namespaces", "--namespace", "--standalone", "--liveness", "--verbose"):
        assert flag in out


def test_unknown_flags_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--no-such-flag"]) == 2
    err = capsys.readouterr().err
    assert "No such option '--no-such-flag'" in err and "baton operator --help" in err


def test_user_flags_follow_the_preloaded_handlers() -> None:
    assert kopf_args(["-A", "--standalone"]) == ["-m", HANDLERS, "-A", "--standalone"]


def test_operator_imports_without_torch_and_does_not_shadow_stdlib_operator() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any `import torch` now raises ImportError\n"
        "import operator, collections\n"
        "import baton_operator.handlers, baton_operator.main\n"
        "assert operator.__file__.startswith(sys.base_prefix), operator.__file__\n"
        "assert 'runtime' not in sys.modules, 'the operator must not import the runtime'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
