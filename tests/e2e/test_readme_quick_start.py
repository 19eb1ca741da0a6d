"""The README's quick start, run off an NPU as a user here runs it: the command lines are read from README.md
(so a changed line is the line tested) and their answers held to what the README says — `env --json` is
one object; `env --device npu` is exit 4 and one line; each `migrator run Qwen/Qwen3-8B … --output-dir
~/cann-recipes-infer/models` form is exit 4 with nothing written in the checkout; the same link outside a
checkout, from a hub whose weights are over 5 GB, is exit 5 naming the README's download command; an
unreachable hub is the troubleshooting table's line. The hub is a local server speaking the Hub API
(tests/support/hf_fixture.py). The commands' options and the docs links: tests/lint/test_readme.py."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
import subprocess

import pytest

from hf_fixture import HubServer
from locations import REPO_ROOT
from migrator_cli import run_cli
from upstream_checkout import copy_checkout

README = (REPO_ROOT / "README.md").read_text()
WEIGHTS_BYTES = 16_400_000_000        # Qwen3-8B's bf16 safetensors, as the hub lists them


def _section(title: str) -> str:
    start = README.index(f"\n## {title}")
    return README[start:README.index("\n## ", start + 1)]


def _shell_lines(text: str) -> list[str]:
    blocks = re.findall(r"^```(?:bash|sh)?\n(.*?)^```", text, re.S | re.M)
    return [line.split("  #", 1)[0].strip() for block in blocks for line in block.replace("\\\n", " ").splitlines()
            if line.strip()]


QUICK_START = _shell_lines(_section("Quick start"))


def _line(prefix: str) -> list[str]:
    """The README quick start's one command line that starts with `prefix`, as argv."""
    found = [line for line in QUICK_START if line.startswith(prefix)]
    assert len(found) == 1, f"README.md's quick start has no single `{prefix} …` line: {QUICK_START}"
    return shlex.split(found[0])


def _symptom(start: str) -> list[str]:
    """The troubleshooting table's symptom that starts with `start`, as the fragments between its `…`."""
    rows = [row for row in _section("Troubleshooting").splitlines() if row.startswith(f"| {start}")]
    assert len(rows) == 1, f"README.md's troubleshooting table has no single row `{start}`"
    quoted = re.search(r"`([^`]+)`", rows[0]).group(1)
    return [part.strip() for part in quoted.split("…") if part.strip()]


def _one_error_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("migrator: error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return errors[0]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny_checkpoints):
    """A user's home: the checkout at ~/cann-recipes-infer, the downloaded weights where the README puts them."""
    home = tmp_path_factory.mktemp("home")
    copy_checkout(home)
    weights = home / "data" / "models" / "Qwen3-8B"
    shutil.copytree(tiny_checkpoints("qwen3"), weights)
    return home


@pytest.fixture(scope="module")
def hub(tiny_checkpoints):
    files = {p.name: p.read_bytes() for p in tiny_checkpoints("qwen3").iterdir() if p.is_file()}
    server = HubServer({"Qwen/Qwen3-8B": files}, listed_sizes={"Qwen/Qwen3-8B/model.safetensors": WEIGHTS_BYTES})
    yield server
    server.close()


def _as_typed(argv: list[str], home) -> list[str]:
    """argv after `migrator`, as the user's shell passes it: `~` is the home, /data/… lives in it."""
    out = []
    for word in argv[1:]:
        word = re.sub(r"^~(?=/)", str(home), word)
        out.append(str(home / word.lstrip("/")) if word.startswith("/data/") else word)
    return out


def test_env_json_is_one_object(tmp_path):
    proc = run_cli("env", "--json", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    env = json.loads(proc.stdout)
    assert {"device", "torch_npu_version", "npu_model"} <= set(env)


def test_env_device_npu_without_an_npu_is_exit_4_and_one_line(tmp_path):
    argv = _line("migrator env --device npu")
    proc = run_cli(*argv[1:], cwd=tmp_path, timeout=300)
    if proc.returncode == 0:
        pytest.skip("this host has a usable NPU")
    assert proc.returncode == 4
    assert _one_error_line(proc).startswith("migrator: error: --device npu requested but")


@pytest.mark.parametrize("prefix", ["migrator run Qwen/Qwen3-8B --output-dir", "migrator run Qwen/Qwen3-8B --weights"])
def test_a_checkout_migration_off_an_npu_is_exit_4_and_writes_nothing(prefix, home, hub):
    argv = _line(prefix)
    assert "~/cann-recipes-infer/models" in argv
    checkout = home / "cann-recipes-infer"
    registry = (checkout / "executor" / "core" / "support_models.py").read_bytes()
    asked = len(hub.requests)
    proc = run_cli(*_as_typed(argv, home), cwd=home, timeout=600,
                   env={"HOME": str(home), "HF_HOME": str(home / "hf"), "HF_ENDPOINT": hub.url})
    assert proc.returncode == 4, proc.stderr[-2000:]
    line = _one_error_line(proc)
    for part in _symptom("exit 4: `… needs an Ascend NPU"):
        assert part in line, (part, line)
    assert "nothing was written" in line and "migrator standin -- migrator run Qwen/Qwen3-8B" in line
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=checkout,
                            capture_output=True, text=True, check=True).stdout
    assert status == "" and (checkout / "executor" / "core" / "support_models.py").read_bytes() == registry
    assert hub.requests[asked:] == [], "nothing is fetched before the refusal"


def test_a_real_model_s_weights_are_exit_5_with_the_readme_s_download_command(tmp_path, hub):
    """The quick start's link where no NPU is needed (a standalone recipe): the hub lists 16.4 GB of weights."""
    argv = _line("migrator run Qwen/Qwen3-8B --output-dir")
    out = tmp_path / "models"
    typed = [str(out) if word.startswith("~/") else word for word in argv[1:]]
    proc = run_cli(*typed, cwd=tmp_path, timeout=600, env={"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub.url})
    assert proc.returncode == 5, proc.stderr[-2000:]
    line = _one_error_line(proc)
    for part in _symptom("exit 5:"):
        assert part in line, (part, line)
    assert "16.4 GB" in line and "--weights DIR" in line
    download = " ".join(_line("hf download"))
    suggested = re.search(r"`(hf download [^`]+)`", line).group(1)
    assert suggested.replace("DIR", "/data/models/Qwen3-8B") == download, (suggested, download)
    assert not (out / "qwen3_8b").exists()
    assert [p for m, p in hub.requests if m == "GET" and p.endswith("/model.safetensors")] == []


def test_an_unreachable_hub_is_the_troubleshooting_line(tmp_path):
    proc = run_cli("run", "Qwen/Qwen3-8B", "--output-dir", str(tmp_path / "models"), cwd=tmp_path, timeout=300,
                   env={"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"})
    assert proc.returncode == 2
    line = _one_error_line(proc)
    for part in _symptom("exit 2: `not in the local Hugging Face cache"):
        assert part in line, (part, line)
