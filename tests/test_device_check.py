"""scripts/device_check.sh end to end in its CPU smoke mode (TREESPEC_CHECK_DEVICE=cpu): the build, the bad
inputs in a subprocess, `pytest -m cuda tests/test_cuda.py` on the CPU op and `scripts/device_timing.py
--smoke`. A GPU is lent for a few minutes at a time: a device run that breaks should break here first.
About 1-1.5 minutes (the extension is already built in $TREESPEC_CACHE by the other tests)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from treespec import ops
from treespec.io import cache_root

ROOT = Path(__file__).resolve().parents[1]


def test_the_device_run_passes_on_the_cpu_and_writes_its_results(tmp_path):
    if shutil.which("bash") is None or not ops.available("cpu"):
        pytest.skip(f"needs bash and treespec's compiled CPU ops ({ops.build_info()['error']})")
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "TREESPEC_CHECK_DEVICE": "cpu",
        "PYTHON": sys.executable,
        "TREESPEC_CACHE": str(cache_root()),  # the extension and the converted model this run already has
    }
    proc = subprocess.run(
        ["bash", "scripts/device_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    output = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, output
    assert "== device check exit status 0" in (tmp_path / "device_check.log").read_text()
    suite = ET.parse(tmp_path / "pytest-cuda.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    ran = int(suite.get("tests")) - int(suite.get("skipped"))
    assert ran >= 40 and suite.get("failures") == "0" and suite.get("errors") == "0", output
    timing = json.loads((tmp_path / "device_timing.json").read_text())
    assert timing["format"] == "treespec.device_timing" and timing["smoke"] and timing["models"], output
