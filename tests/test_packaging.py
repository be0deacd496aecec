"""The package a stranger installs: one top-level name (`batchserve`), every file it reads at run time
inside the wheel, and a wheel that runs with no source tree around (issue 65).

The wheel is built once per session (`python -m build --no-isolation`: no download) and installed into a
fresh venv that sees this environment's dependencies through a path entry, not batchserve's editable
install, then run from an empty directory."""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOPS = ("procs", "kernels", "shared", "loadtests")
# Files read at run time beside the modules; a wheel without them serves nothing (or no web page).
RUN_TIME_DATA = (
    "batchserve/kernels/csrc/decode_layers.c",
    "batchserve/kernels/csrc/vec8.h",
    "batchserve/procs/api/webui/chat.html",
    "batchserve/procs/api/webui/dashboard.js",
    "batchserve/systemd/batchserve-worker@.service",
    "batchserve/systemd/batchserve.env",
    "batchserve/systemd/grafana/batchserve-dashboard.json",
    "batchserve/loadtests/data/english_text.txt",
)


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_the_package_list_names_every_package_folder():
    setuptools = _pyproject()["tool"]["setuptools"]
    folders = {
        "batchserve." + ".".join(p.parent.relative_to(REPO).parts)
        for top in TOPS
        for p in (REPO / top).rglob("__init__.py")
    }
    assert set(setuptools["packages"]) == folders | {"batchserve.systemd"}
    assert setuptools["package-dir"] == {f"batchserve.{top}": top for top in (*TOPS, "systemd")}


def test_every_upper_bound_says_what_it_avoids():
    """A pin or upper bound on a dependency carries a comment naming the break (read from the source)."""
    lines = (REPO / "pyproject.toml").read_text().splitlines()
    bounded = [line for line in lines if line.strip().startswith('"') and ("<" in line or "==" in line)]
    assert bounded, "the scan found no bounded dependency at all"
    assert [line for line in bounded if "#" not in line] == []
    assert not any(line.strip().startswith('"transformers') and "<" in line for line in lines)


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of what it is made of (setuptools writes build/ beside the sources)."""
    source = tmp_path_factory.mktemp("source")
    for name in (*TOPS, "systemd"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(source)],
        check=True,
        capture_output=True,
        cwd=out,
    )
    (built,) = out.glob("batchserve-*.whl")
    return built


def test_the_wheel_installs_one_top_level_package_with_its_data(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"batchserve", f"{wheel.name.split('-py')[0]}.dist-info"}
    assert [path for path in RUN_TIME_DATA if path not in names] == []
    assert "batchserve/__init__.py" not in names  # a namespace: nothing of its own to shadow


def test_the_wheel_keeps_a_newer_transformers(wheel: Path):
    """Installing the wheel over this environment (whatever transformers it has, >= 5.25 in CI) changes
    no installed dependency: pip's plan holds batchserve alone."""
    report = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--quiet", "--report", "-", str(wheel)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    planned = [item["metadata"]["name"] for item in json.loads(report)["install"]]
    assert planned == ["batchserve"]


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding the wheel; the dependencies come from this environment's site-packages as a plain
    path entry, so its .pth files (batchserve's editable finder among them) are not run."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", str(wheel)],
        check=True,
    )
    query = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = Path(subprocess.check_output([str(python), "-c", query], text=True).strip())
    (purelib / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return venv


def _run(venv: Path, cwd: Path, *args: str) -> str:
    result = subprocess.run(
        [str(venv / "bin" / "batchserve"), *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_the_wheel_serves_from_outside_the_checkout(fresh_venv: Path, tmp_path: Path, tiny_model_dir):
    where = subprocess.check_output(
        [str(fresh_venv / "bin" / "python"), "-c", "import batchserve.procs.cli as c; print(c.__file__)"],
        cwd=tmp_path,
        text=True,
    )
    assert where.startswith(str(fresh_venv)), where
    # Hugging Face's `kernels` (transformers >= 5.25 imports it) and ours side by side
    both = "import importlib.util as u, batchserve.kernels.native; s = u.find_spec('kernels'); print(s and s.origin)"
    hf_kernels = subprocess.check_output([str(fresh_venv / "bin" / "python"), "-c", both], cwd=tmp_path, text=True)
    assert "batchserve" not in hf_kernels, hf_kernels
    assert "--model" in _run(fresh_venv, tmp_path, "serve", "--help")

    model = tiny_model_dir("llama", with_tokenizer=True)
    out = _run(
        fresh_venv, tmp_path, "generate", "--model", str(model), "--prompt", "w5 w6 w7", "--max-tokens", "4", "--json"
    )
    assert out.strip(), "generate printed nothing"

    scenario = tmp_path / "two.json"
    scenario.write_text(
        json.dumps(
            {
                "name": "two",
                "config": {"max_running_requests": 1, "prefill_budget": 16, "kv_capacity_tokens": 1000},
                "requests": [
                    {"id": "A", "arrival_step": 0, "input_tokens": 3, "output_tokens": 2},
                    {"id": "B", "arrival_step": 0, "input_tokens": 2, "output_tokens": 1},
                ],
            }
        )
    )
    trace = [json.loads(line) for line in _run(fresh_venv, tmp_path, "simulate", str(scenario)).splitlines()]
    assert trace[0] == {"step": 0, "prefill": [["A", 3]], "decode": [], "finished": [], "cancelled": []}
