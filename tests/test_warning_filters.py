"""pyproject's ``filterwarnings`` drops the third-party warnings the project cannot act on, by the module that warns,
and nothing else: the same warning from another module is still shown at the end of the run."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO

WARNINGS = """
import warnings

def warn(message, category, module):
    warnings.warn_explicit(message, category, filename=module.replace(".", "/") + ".py", lineno=1, module=module)

def test_warn():
    warn("`gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning, "transformers.training_args")
    warn("`torch.jit.script_method` is deprecated. Please switch to `torch.compile`.", DeprecationWarning, "torch.jit._script")
    warn("The number of training batches (15) is smaller than the logging interval", UserWarning, "lightning.pytorch.loops")
    warn("a warning of the project's own", UserWarning, "tatblimp_callback.training.callback")
    warn("`gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning, "tatblimp_callback.evaluation")
    warn("another deprecation of transformers", FutureWarning, "transformers.modeling_utils")
"""


def test_only_the_named_third_party_warnings_are_filtered(tmp_path):
    (tmp_path / "test_warns.py").write_text(WARNINGS)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(REPO / "pyproject.toml"), "test_warns.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    assert re.search(r"^1 passed, 3 warnings in ", done.stdout.splitlines()[-1])
    shown = re.findall(r"^  \S+: (\w+): (.*)$", done.stdout, re.M)
    assert shown == [
        ("UserWarning", "a warning of the project's own"),
        ("FutureWarning", "`gradient_checkpointing` is deprecated and will be removed in v6."),
        ("FutureWarning", "another deprecation of transformers"),
    ]
