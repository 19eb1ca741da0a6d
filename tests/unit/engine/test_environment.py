"""Tests for engine.environment and its backends (engine/backends/): npu-smi parsing, CANN
version files, torch/torch_npu pairing, device selection, and the real "torch_npu installed
without CANN" state."""

from __future__ import annotations

import json
import os
import platform
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from npu_wheel import torch_npu_wheel
from engine.backends import npu as npu_backend   # where the CANN default install paths live
from engine.environment import (
    DeviceUnavailableError,
    detect_cann_version,
    detect_environment,
    detect_npu,
    parse_npu_smi,
    probe_torch_npu,
    select_device,
    synchronize,
    torch_pair_ok,
)
from locations import REPO_ROOT, DATA

REPO = REPO_ROOT
NPU_SMI_DATA = DATA / "npu_smi"

# file -> (npu_model, num_cards, num_chips)
NPU_SMI_SAMPLES = {
    "910b4_x8_atlas800i_a2.txt": ("Ascend 910B4", 8, 8),
    "910b3_x2.txt": ("Ascend 910B3", 2, 2),
    "910b_x4_older_layout.txt": ("Ascend 910B", 4, 4),
    "310p3_duo_x2_4chips.txt": ("Ascend 310P3", 2, 4),
    "a3_ascend910_x8_2chips.txt": ("Ascend 910", 8, 16),
    "error_device_busy.txt": (None, 0, 0),
}


# ---------------------------------------------------------------------------------------------
# npu-smi
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(NPU_SMI_SAMPLES))
def test_parse_npu_smi_samples(name):
    model, cards, chips = NPU_SMI_SAMPLES[name]
    info = parse_npu_smi((NPU_SMI_DATA / name).read_text())
    assert info["npu_model"] == model
    assert info["num_cards"] == cards
    assert info["num_chips"] == chips


@pytest.mark.parametrize("text", [
    "",
    "garbage\nnot a table at all\n",
    "npu-smi: command not found\n",
    "| a | b | c |\n| 1 2 | x | y |\n",
    "| 0  foo | bar | baz |\n| 1 | qux | quux |\n",  # two table rows, but no bus id
])
def test_parse_npu_smi_garbage(text):
    info = parse_npu_smi(text)
    assert info["npu_model"] is None
    assert info["num_cards"] == 0
    assert info["num_chips"] == 0


def test_parse_npu_smi_normalises_ascend_prefixed_names():
    text = (NPU_SMI_DATA / "a3_ascend910_x8_2chips.txt").read_text()
    info = parse_npu_smi(text.replace("Ascend910     ", "Ascend910_9392"))
    assert info["npu_model"] == "Ascend 910_9392"
    assert (info["num_cards"], info["num_chips"]) == (8, 16)


def test_parse_npu_smi_ignores_process_table():
    # The A2 sample has a running process on NPU 4 ("| 4       0  | 172931 | python3 ...").
    text = (NPU_SMI_DATA / "910b4_x8_atlas800i_a2.txt").read_text()
    assert "172931" in text
    device_part = text.split("Process id")[0]
    assert parse_npu_smi(text) == parse_npu_smi(device_part)


def _fake_npu_smi(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "npu-smi"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC | stat.S_IXGRP | stat.S_IXOTH)


def test_detect_npu_runs_npu_smi_from_path(tmp_path, monkeypatch):
    sample = NPU_SMI_DATA / "910b4_x8_atlas800i_a2.txt"
    _fake_npu_smi(tmp_path / "bin", f'[ "$1" = info ] || exit 2\ncat "{sample}"\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    info = detect_npu()
    assert info["npu_smi"] == "ok"
    assert (info["npu_model"], info["num_cards"], info["num_chips"]) == ("Ascend 910B4", 8, 8)


def test_detect_npu_failing_npu_smi(tmp_path, monkeypatch):
    _fake_npu_smi(tmp_path / "bin",
                  'echo "dcmi model initialized failed, because the device is used. ret is -8020"\n'
                  "exit 1\n")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    info = detect_npu()
    assert info["num_cards"] == 0 and info["npu_model"] is None
    assert info["npu_smi"].startswith("failed: dcmi model initialized failed")


def test_detect_npu_without_npu_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no npu-smi
    info = detect_npu()
    assert info == {"npu_model": None, "num_cards": 0, "num_chips": 0, "npu_models": [], "chip_memory_bytes": None,
                    "npu_smi": "not found"}


# ---------------------------------------------------------------------------------------------
# CANN version
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def no_default_cann(monkeypatch, tmp_path):
    """Keep a real /usr/local/Ascend install out of these tests."""
    monkeypatch.setattr(npu_backend, "DEFAULT_TOOLKIT_HOMES", (str(tmp_path / "no-default-cann"),))


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def test_cann_version_from_toolkit_install_info(tmp_path, no_default_cann):
    root = tmp_path / "ascend-toolkit" / "latest"
    _write(root / f"{platform.machine()}-linux" / "ascend_toolkit_install.info", """
        package_name=Ascend-cann-toolkit
        version=8.3.RC2
        innerversion=V100R001C23SPC002B210
        arch=x86_64
        os=linux
        path=/usr/local/Ascend/ascend-toolkit/8.3.RC2/x86_64-linux
    """)
    assert detect_cann_version({"ASCEND_TOOLKIT_HOME": str(root)}) == "8.3.RC2"


def test_cann_version_install_info_of_other_arch_dir(tmp_path, no_default_cann):
    root = tmp_path / "cann-8.5.0"
    other = "aarch64" if platform.machine() != "aarch64" else "x86_64"
    _write(root / f"{other}-linux" / "ascend_toolkit_install.info",
           "package_name=Ascend-cann-toolkit\nversion=8.5.0\n")
    assert detect_cann_version({"ASCEND_HOME_PATH": str(root)}) == "8.5.0"


def test_cann_version_from_version_cfg(tmp_path, no_default_cann):
    root = tmp_path / "latest"
    _write(root / "version.cfg", """
        # version: 1.0
        runtime_running_version=[7.3.0.1.231:8.0.RC2]
        compiler_running_version=[7.3.0.1.231:8.0.RC2]
        hccl_running_version=[7.3.0.1.231:8.0.RC2]
        toolkit_running_version=[7.3.0.1.231:8.0.RC2]
    """)
    assert detect_cann_version({"ASCEND_HOME_PATH": str(root)}) == "8.0.RC2"


def test_cann_version_from_compiler_version_info(tmp_path, no_default_cann):
    # CANN 8.0: "Version=" is the component's internal number, "version_dir=" the release.
    root = tmp_path / "latest"
    _write(root / "compiler" / "version.info", """
        Version=7.6.0.1.220
        version_dir=8.0.0
        timestamp=20241212_000000
    """)
    assert detect_cann_version({"ASCEND_TOOLKIT_HOME": str(root)}) == "8.0.0"


def test_cann_version_from_runtime_version_info(tmp_path, no_default_cann):
    root = tmp_path / "latest"
    _write(root / "runtime" / "version.info", "version=8.1.RC1\n")
    assert detect_cann_version({"ASCEND_TOOLKIT_HOME": str(root)}) == "8.1.RC1"


def test_cann_version_prefers_install_info_and_toolkit_home(tmp_path, no_default_cann):
    toolkit = tmp_path / "toolkit"
    _write(toolkit / f"{platform.machine()}-linux" / "ascend_toolkit_install.info", "version=8.2.RC1\n")
    _write(toolkit / "version.cfg", "runtime_running_version=[7.7.0.1.238:8.1.RC1]\n")
    home = tmp_path / "home"
    _write(home / "version.cfg", "runtime_running_version=[7.3.0.1.231:8.0.RC2]\n")
    environ = {"ASCEND_TOOLKIT_HOME": str(toolkit), "ASCEND_HOME_PATH": str(home)}
    assert detect_cann_version(environ) == "8.2.RC1"


def test_cann_version_default_path(tmp_path, monkeypatch):
    default = tmp_path / "usr-local-Ascend-ascend-toolkit-latest"
    _write(default / "version.cfg", "runtime_running_version=[7.6.0.1.220:8.0.0]\n")
    monkeypatch.setattr(npu_backend, "DEFAULT_TOOLKIT_HOMES", (str(default),))
    assert detect_cann_version({}) == "8.0.0"


def test_cann_version_absent(tmp_path, no_default_cann):
    assert detect_cann_version({}) is None
    assert detect_cann_version({"ASCEND_TOOLKIT_HOME": str(tmp_path / "missing")}) is None
    empty = tmp_path / "empty-toolkit"
    empty.mkdir()
    assert detect_cann_version({"ASCEND_HOME_PATH": str(empty)}) is None


# ---------------------------------------------------------------------------------------------
# torch / torch_npu pairing and device selection
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("torch_v, npu_v, expected", [
    ("2.13.0+cpu", "2.13.0", True),
    ("2.6.0", "2.6.0.post1", True),
    ("2.1.0+cpu", "2.1.0.post10", True),
    ("2.6.0+cpu", "2.5.1", False),
    ("2.6.0", "2.6.1.post1", False),
    ("2.13.0", "2.1.3", False),
    ("2.13.0+cpu", None, None),
    ("2.13.0+cpu", "", None),
    ("not-a-version", "2.6.0", False),
    (None, "2.6.0", False),
])
def test_torch_pair_ok(torch_v, npu_v, expected):
    assert torch_pair_ok(torch_v, npu_v) is expected


def test_select_device_cpu():
    import torch

    assert select_device("cpu") == torch.device("cpu")
    assert select_device("CPU").type == "cpu"
    synchronize(select_device("cpu"))  # no-op on cpu
    synchronize("cpu")


def test_select_device_rejects_unknown_names():
    with pytest.raises(ValueError):
        select_device("tpu")
    with pytest.raises(ValueError):
        select_device("npu:x")


def test_select_device_npu_unavailable_is_one_line():
    probe = probe_torch_npu()
    if probe["status"] == "ok":
        pytest.skip("torch_npu is usable here")
    for requested in ("npu", "npu:1"):
        with pytest.raises(DeviceUnavailableError) as info:
            select_device(requested)
        message = str(info.value)
        assert "\n" not in message
        assert message.startswith(f"--device {requested} requested but {probe['status']}; ")
        assert "--device cpu" in message


def test_select_device_cuda_unavailable():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(DeviceUnavailableError) as info:
        select_device("cuda")
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("--device cuda requested but ")


def test_cuda_selection_and_record_with_a_faked_cuda(monkeypatch):
    """The CUDA branch, on a CPU-only machine: torch.cuda answers are faked."""
    import torch

    if probe_torch_npu()["status"] == "ok":
        pytest.skip("an NPU would win the auto selection here")

    class Props:
        name = "NVIDIA H200"
        total_memory = 150_000_000_000

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda idx=0: Props())
    assert select_device("auto") == torch.device("cuda", 0)
    assert select_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(DeviceUnavailableError, match=r"only 1 CUDA device\(s\) are visible"):
        select_device("cuda:1")
    env = detect_environment("cuda")
    assert env["device"] == "cuda"
    assert env["cuda_device_name"] == "NVIDIA H200"
    assert env["cuda_memory_bytes"] == env["device_memory_bytes"] == 150_000_000_000
    assert detect_environment("cpu")["device_memory_bytes"] == env["memory_bytes"]


def test_probe_torch_npu_shape():
    probe = probe_torch_npu()
    assert set(probe) == {"installed", "importable", "version", "status", "error"}
    if not probe["installed"]:
        assert probe == {"installed": False, "importable": False, "version": None,
                         "status": "torch_npu not installed", "error": None}


def test_detect_environment_on_this_machine():
    import torch

    if torch.cuda.is_available() or probe_torch_npu()["status"] == "ok":
        pytest.skip("an accelerator is usable here; this test describes a CPU-only machine")
    env = detect_environment()
    json.dumps(env)  # JSON-serialisable
    for key in ("device", "npu_model", "num_cards", "cann_version", "pytorch_version",
                "torch_npu_version", "torch_npu_status", "torch_pair_ok", "cuda_device_name",
                "cuda_memory_bytes", "cpu_model", "cpu_count", "memory_bytes",
                "device_memory_bytes"):
        assert key in env
    assert env["device"] == "cpu"
    assert env["pytorch_version"] == torch.__version__
    assert env["cuda_device_name"] is None and env["cuda_memory_bytes"] is None
    assert env["cpu_count"] == os.cpu_count()
    assert env["memory_bytes"] > 0
    assert env["device_memory_bytes"] == env["memory_bytes"]
    assert env["torch_npu_status"] == probe_torch_npu()["status"]
    assert detect_environment("cpu")["device"] == "cpu"
    with pytest.raises(DeviceUnavailableError):
        detect_environment("npu")  # never recorded as an NPU run


# ---------------------------------------------------------------------------------------------
# the real state: torch_npu installed, no CANN
# ---------------------------------------------------------------------------------------------


def _torch_release() -> str:
    from importlib.metadata import version

    return version("torch").split("+", 1)[0]


@pytest.fixture(scope="session")
def torch_npu_target_dir() -> Path:
    """The real torch-npu wheel (same release as torch), unpacked once into a cache dir (conftest)."""
    target, why = torch_npu_wheel()
    if target is None:
        pytest.skip(why)
    return target


def _run_with_torch_npu(target: Path, code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCH_DEVICE_BACKEND_AUTOLOAD", "ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")}
    env["PYTHONPATH"] = os.pathsep.join([str(target), str(REPO)])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_torch_npu_without_cann_reports_cann_runtime_not_found(torch_npu_target_dir):
    if shutil.which("npu-smi") or Path("/usr/local/Ascend").exists():
        pytest.skip("this machine has Ascend software; the no-CANN state cannot be reproduced")
    proc = _run_with_torch_npu(torch_npu_target_dir, """
        import json, os
        from engine import environment as e
        out = {"probe": e.probe_torch_npu(), "env": e.detect_environment()}
        try:
            e.select_device("npu")
        except e.DeviceUnavailableError as exc:
            out["npu_error"] = str(exc)
        out["cpu"] = str(e.select_device("cpu"))
        out["autoload_env"] = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD")
        print("RESULT " + json.dumps(out))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    probe, env = out["probe"], out["env"]
    assert probe["installed"] is True
    assert probe["importable"] is False
    assert probe["version"] == _torch_release()
    assert probe["status"] == "torch_npu present, CANN runtime not found"
    assert "libhccl.so" in probe["error"]
    assert env["device"] == "cpu"
    assert env["torch_npu_status"] == "torch_npu present, CANN runtime not found"
    assert env["torch_npu_version"] == _torch_release()
    assert env["torch_pair_ok"] is True
    assert env["device_memory_bytes"] == env["memory_bytes"]
    assert out["npu_error"] == (
        "--device npu requested but torch_npu present, CANN runtime not found; "
        "install CANN and source set_env.sh, or use --device cpu")
    assert out["cpu"] == "cpu"
    assert out["autoload_env"] is None  # the guard leaves the caller's environment as it was


@pytest.mark.slow  # by default the env report and `migrator env` tests here cover the no-CANN state
def test_torch_npu_without_cann_breaks_plain_import_torch(torch_npu_target_dir):
    """Why engine.environment guards `import torch`: torch's backend autoload imports torch_npu,
    whose failure makes `import torch` itself fail; TORCH_DEVICE_BACKEND_AUTOLOAD=0 avoids it."""
    if shutil.which("npu-smi") or Path("/usr/local/Ascend").exists():
        pytest.skip("this machine has Ascend software; the no-CANN state cannot be reproduced")
    plain = _run_with_torch_npu(torch_npu_target_dir, "import torch")
    assert plain.returncode != 0
    assert "Failed to load the backend extension: torch_npu" in plain.stderr
    assert "libhccl.so: cannot open shared object file" in plain.stderr
    guarded = _run_with_torch_npu(torch_npu_target_dir, """
        from engine.environment import import_torch
        print(import_torch().ones(2).sum().item())
    """)
    assert guarded.returncode == 0, guarded.stderr[-3000:]
    assert guarded.stdout.strip().endswith("2.0")


@pytest.mark.slow  # by default the env report and `migrator env` tests here cover the no-CANN state
def test_recipe_runs_with_torch_npu_installed_without_cann(torch_npu_target_dir, working_recipe, tmp_path):
    """A rendered recipe imports torch only through the engine's guard, so the real
    torch-npu==<torch release> install without CANN (on PYTHONPATH) does not break `bash infer.sh`."""
    if shutil.which("npu-smi") or Path("/usr/local/Ascend").exists():
        pytest.skip("this machine has Ascend software; the no-CANN state cannot be reproduced")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCH_DEVICE_BACKEND_AUTOLOAD", "ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")}
    env.update(PYTHONPATH=os.pathsep.join([str(torch_npu_target_dir), str(REPO)]), PYTHON=sys.executable,
               RES_PATH=str(tmp_path / "res"))
    proc = subprocess.run(["bash", str(working_recipe / "infer.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "res" / "log_0.log").read_text()
    assert log.count("inference time cost of prefill") == 2
    assert "Request 0: outputs:" in log


def test_migrator_imports_transformers_with_torch_npu_installed_without_cann(torch_npu_target_dir):
    """transformers' is_torch_npu_available() imports torch_npu unguarded whenever it is installed;
    after the engine's probe found it unusable, that import is a clean ImportError instead of a
    libhccl.so crash, and `migrator env` still reports the real state."""
    if shutil.which("npu-smi") or Path("/usr/local/Ascend").exists():
        pytest.skip("this machine has Ascend software; the no-CANN state cannot be reproduced")
    proc = _run_with_torch_npu(torch_npu_target_dir, """
        import sys
        from agent.cli import main
        sys.exit(main(["env", "--json"]))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert env["torch_npu_status"] == "torch_npu present, CANN runtime not found"
    assert env["device"] == "cpu"
    plain = _run_with_torch_npu(torch_npu_target_dir, """
        from engine.environment import import_torch
        import_torch()
        import transformers.modeling_utils  # imports torch_npu when it is installed
        print("imported")
    """)
    assert plain.returncode == 0 and "imported" in plain.stdout, plain.stderr[-3000:]
