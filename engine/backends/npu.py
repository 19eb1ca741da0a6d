"""The NPU backend: Ascend chips (npu-smi), the CANN toolkit and torch_npu.

Every NPU fact is reported as found, including the common broken state "torch_npu present, CANN
runtime not found". torch_npu is optional: nothing here imports torch or torch_npu at module
import time; both are imported lazily and guarded, see `import_torch()` and `probe_torch_npu()`.
`import_torch()` lives here because torch_npu is the only reason `import torch` needs a guard.

Why `import torch` itself needs a guard (checked with torch 2.13.0+cpu and torch-npu 2.13.0,
no CANN installed):

* torch >= 2.5 auto-loads out-of-tree backends at the end of `import torch`: it loads every
  `torch.backends` entry point, and torch_npu registers one (`torch_npu = torch_npu:_autoload`).
* Without CANN, `import torch_npu` fails with
  ``ImportError: libhccl.so: cannot open shared object file: No such file or directory``,
  so a plain `import torch` then fails too, with
  ``RuntimeError: Failed to load the backend extension: torch_npu. You can disable extension
  auto-loading with TORCH_DEVICE_BACKEND_AUTOLOAD=0.`` -- even for a CPU-only run.
* After that failure `import torch` cannot be retried in the same process (the second attempt
  dies on "Only a single TORCH_LIBRARY can be used to register the namespace triton"), so the
  guard has to be in place before the first `import torch`.
* With TORCH_DEVICE_BACKEND_AUTOLOAD=0, `import torch` works and `import torch_npu` can be tried
  explicitly, which is what `import_torch()` / `probe_torch_npu()` do.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

from engine.backends.base import Backend
from engine.backends.common import dist_version, exception_chain, first_line, short_error

AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"

STATUS_NOT_INSTALLED = "torch_npu not installed"
STATUS_NO_CANN = "torch_npu present, CANN runtime not found"
STATUS_IMPORT_FAILED = "torch_npu import failed"  # followed by ": <short reason>"
STATUS_TIMED_OUT = "torch_npu import timed out"  # followed by " after N s (...)"

# An `import torch_npu` (and the CANN it loads) can block: a hung driver, a device held by another
# process. It is tried first in a child process, bounded by this many seconds (env override).
IMPORT_TIMEOUT_ENV = "MIGRATOR_IMPORT_TIMEOUT_S"
DEFAULT_IMPORT_TIMEOUT_S = 90.0
_PROBED_ENV = "MIGRATOR_TORCH_NPU_IMPORTS"   # set after a child import worked: this interpreter's children skip it
STATUS_OK = "ok"

DEFAULT_TOOLKIT_HOMES = (
    "/usr/local/Ascend/ascend-toolkit/latest",  # CANN <= 8.3 default install
    "/usr/local/Ascend/cann",  # CANN >= 8.5 default install
)

# Shared libraries that come with CANN (toolkit / nnae / driver). A torch_npu import that fails
# because one of these cannot be loaded means "CANN runtime not found", not a broken torch_npu.
_CANN_LIB_RE = re.compile(
    r"\blib(?:hccl|ascendcl|ascend_hal|acl_\w+|ge_\w+|graph|runtime|opapi|nnopbase|c_sec|mmpa|"
    r"ascend_\w+|register|error_manager|platform|tiling_api|profapi|msprof\w*|drvdsmi\w*|dcmi|"
    r"aicpu\w*|fmk_\w+|lowering|exe_graph|ops\w*|alog|slog|unified_dlog)\.so"
)
_MISSING_LIB_MARKERS = ("cannot open shared object file", "No such file or directory", "not found")


LABEL = "NPU"   # in "only N NPU device(s) are visible"

# ---------------------------------------------------------------------------------------------
# npu-smi
# ---------------------------------------------------------------------------------------------


def _normalise_npu_name(name: str) -> str:
    name = name.strip()
    name = re.sub(r"^Ascend[\s_-]*", "", name, flags=re.IGNORECASE)
    return f"Ascend {name}" if name else "Ascend"


def parse_npu_smi(text: str) -> dict:
    """Parse the box table printed by `npu-smi info`.

    Each chip is a block of two rows between separator lines:
        | <npu id>  <name>      | <health> | power  temp  hugepages |
        | <chip id> [<phy/dev>] | <bus id> | aicore memory hbm      |
    Multi-chip cards (Atlas 300I Duo 310P3, A3 "Ascend910") repeat the NPU row for each chip.
    Parsing stops at the process table ("| NPU  Chip | Process id | ...").

    Returns {"npu_model": "Ascend <name>" | None, "num_cards": int, "num_chips": int,
    "npu_models": [distinct models], "chip_memory_bytes": the smallest chip's memory | None}. Garbage
    or empty text gives no cards and model None.
    """
    blocks: list[list[list[str]]] = []
    current: list[list[str]] = []
    for raw in (text or "").splitlines():
        line = raw.strip()
        if line.startswith("+"):
            if current:
                blocks.append(current)
            current = []
            continue
        if not (line.startswith("|") and line.count("|") >= 3):
            if current:
                blocks.append(current)
            current = []
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if any(c.startswith("Process id") for c in cells) or "Process name" in line:
            break  # the process table follows: no more devices
        current.append(cells)
    if current and not any("Process" in " ".join(r) for r in current):
        blocks.append(current)

    npu_row = re.compile(r"^(\d+)\s+(\S+(?:\s\S+)*)$")
    chip_row = re.compile(r"^(\d+)(?:\s+\d+)?$")
    bus_id = re.compile(r"^(?:[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]|NA|-)$")
    cards: list[str] = []
    names: list[str] = []
    chip_memory: list[int] = []
    chips = 0
    for block in blocks:
        if len(block) < 2 or len(block[0]) < 2 or len(block[1]) < 2:
            continue
        first, second = block[0], block[1]
        m = npu_row.match(first[0])
        if not m or not chip_row.match(second[0]):
            continue
        npu_id, name = m.group(1), m.group(2)
        if not first[1] or not bus_id.match(second[1]):  # health filled, bus id well formed
            continue
        chips += 1
        if npu_id not in cards:
            cards.append(npu_id)
        model = _normalise_npu_name(name)
        if model not in names:
            names.append(model)
        # "AICore(%)  Memory-Usage(MB)  HBM-Usage(MB)": the last "used / total" is the chip's own
        # memory (HBM; a 310P has only the first pair, its DDR).
        pairs = re.findall(r"(\d+)\s*/\s*(\d+)", second[2]) if len(second) > 2 else []
        if pairs and int(pairs[-1][1]) > 0:
            chip_memory.append(int(pairs[-1][1]) * 2**20)
    return {
        "npu_model": names[0] if names else None,
        "num_cards": len(cards),
        "num_chips": chips,
        "npu_models": names,
        "chip_memory_bytes": min(chip_memory) if chip_memory else None,   # the smallest chip's
    }


def detect_npu(timeout: float = 10.0) -> dict:
    """Run `npu-smi info` if it is on PATH and parse it; a missing or failing tool gives 0 cards.

    The result also carries "npu_smi": "ok" | "not found" | "failed: <reason>".
    """
    empty = {"npu_model": None, "num_cards": 0, "num_chips": 0, "npu_models": [], "chip_memory_bytes": None}
    exe = shutil.which("npu-smi")
    if exe is None:
        return {**empty, "npu_smi": "not found"}
    try:
        proc = subprocess.run([exe, "info"], capture_output=True, text=True, timeout=timeout,
                              errors="replace")
    except subprocess.TimeoutExpired:
        return {**empty, "npu_smi": f"failed: timed out after {timeout:g} s"}
    except OSError as exc:
        return {**empty, "npu_smi": f"failed: {exc}"}
    if proc.returncode != 0:
        reason = first_line(proc.stderr or proc.stdout) or f"exit code {proc.returncode}"
        return {**empty, "npu_smi": f"failed: {reason}"}
    return {**parse_npu_smi(proc.stdout), "npu_smi": "ok"}


# ---------------------------------------------------------------------------------------------
# CANN
# ---------------------------------------------------------------------------------------------


def _read_kv(path: Path) -> dict[str, str]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.splitlines()[:200]:
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.split("=", 1)
        out.setdefault(key.strip().lower(), value.strip().strip('"').strip("'"))
    return out


def _running_version(value: str) -> str | None:
    # version.cfg: runtime_running_version=[7.3.0.1.231:8.0.RC2] -> "8.0.RC2" (the release
    # after the colon; the part before it is the internal component number).
    value = value.strip().strip("[]")
    if not value:
        return None
    release = value.split(":", 1)[1] if ":" in value else value
    return release.strip() or None


def _version_from_toolkit(root: Path) -> str | None:
    # 1. <root>/<arch>-linux/ascend_toolkit_install.info: "version=8.0.RC2" -- what the CANN
    #    install guide tells you to cat to check the version.
    arch_dirs = [root / f"{platform.machine()}-linux"]
    try:
        arch_dirs += sorted(p for p in root.glob("*-linux") if p not in arch_dirs)
    except OSError:
        pass
    for arch_dir in arch_dirs:
        info = _read_kv(arch_dir / "ascend_toolkit_install.info")
        if info.get("version"):
            return info["version"]
    # 2. <root>/version.cfg: "toolkit_running_version=[7.3.0.1.231:8.0.RC2]" (older CANN;
    #    version.info is accepted under the same rules).
    for name in ("version.cfg", "version.info"):
        cfg = _read_kv(root / name)
        for key in ("toolkit_running_version", "runtime_running_version",
                    "compiler_running_version"):
            if cfg.get(key) and _running_version(cfg[key]):
                return _running_version(cfg[key])
        if cfg.get("version_dir"):
            return cfg["version_dir"]
        if cfg.get("version"):
            return cfg["version"]
    # 3. Component files: "version_dir=8.0.0" is the release; "Version=7.6.0.1.220" is the
    #    component's own number on CANN 8.0 (and the release on later CANN), used last.
    for comp in ("runtime", "compiler", "opp", "toolkit"):
        info = _read_kv(root / comp / "version.info")
        if info.get("version_dir"):
            return info["version_dir"]
    for comp in ("runtime", "compiler", "opp", "toolkit"):
        info = _read_kv(root / comp / "version.info")
        if info.get("version"):
            return info["version"]
    return None


def detect_cann_version(environ: dict | None = None) -> str | None:
    """CANN toolkit version ("8.0.RC2", "8.3.RC2", "8.5.0"), or None when no CANN is found.

    Looks in $ASCEND_TOOLKIT_HOME, $ASCEND_HOME_PATH (both set by CANN's set_env.sh), then the
    default install paths.
    """
    env = os.environ if environ is None else environ
    roots: list[str] = []
    for key in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        if env.get(key):
            roots.append(env[key])
    roots += list(DEFAULT_TOOLKIT_HOMES)
    seen: set[str] = set()
    for root in roots:
        if root in seen:
            continue
        seen.add(root)
        path = Path(root)
        if not path.is_dir():
            continue
        version = _version_from_toolkit(path)
        if version:
            return version
    return None


# ---------------------------------------------------------------------------------------------
# torch / torch_npu
# ---------------------------------------------------------------------------------------------


def torch_npu_installed() -> bool:
    """True when a torch_npu distribution or module is on sys.path (without importing it)."""
    if dist_version("torch_npu", "torch-npu") is not None:
        return True
    if "torch_npu" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        return False


class TorchImportError(ImportError):
    """`import torch` failed (typically: the torch_npu backend autoload without CANN)."""


_TORCH_IMPORT_ERROR: BaseException | None = None


def import_torch():
    """Import torch so that a torch_npu without CANN cannot make `import torch` fail.

    When torch_npu is installed and torch is not imported yet, torch is imported with
    TORCH_DEVICE_BACKEND_AUTOLOAD=0 (unless the user set the variable), and the variable is
    restored right after, so child processes inherit the user's setting. torch_npu is then
    imported explicitly by `probe_torch_npu()` -- the same thing the autoload would have done,
    except that its failure is caught and reported instead of killing `import torch`.
    Without torch_npu installed nothing is changed: plain `import torch`.
    """
    global _TORCH_IMPORT_ERROR
    mod = sys.modules.get("torch")
    if mod is not None and hasattr(mod, "__version__"):
        return mod
    if _TORCH_IMPORT_ERROR is not None:  # a failed `import torch` cannot be retried
        raise TorchImportError(short_error(_TORCH_IMPORT_ERROR)) from _TORCH_IMPORT_ERROR
    guard = AUTOLOAD_ENV not in os.environ and torch_npu_installed()
    if not guard and os.environ.get(AUTOLOAD_ENV, "1") != "0" and torch_npu_installed():
        # the user's autoload would import torch_npu inside `import torch`: bounded in a child first
        blocked = import_blocks()
        if blocked:
            _TORCH_IMPORT_ERROR = TimeoutError(blocked)
            raise TorchImportError(f"{blocked}; torch's backend autoload ({AUTOLOAD_ENV}="
                                   f"{os.environ.get(AUTOLOAD_ENV)}) imports it")
    if guard:
        os.environ[AUTOLOAD_ENV] = "0"
    try:
        import torch
    except Exception as exc:
        _TORCH_IMPORT_ERROR = exc
        raise TorchImportError(short_error(exc)) from exc
    finally:
        if guard:
            os.environ.pop(AUTOLOAD_ENV, None)
    if guard and not _PROBING:
        probe_torch_npu()   # a torch_npu that cannot load is blocked before transformers tries it
    return torch


def import_timeout_s(environ=None) -> float:
    """Seconds an import that may block (torch_npu, CANN) is given in a child: MIGRATOR_IMPORT_TIMEOUT_S, a
    positive number (default 90); anything else is the default."""
    raw = (os.environ if environ is None else environ).get(IMPORT_TIMEOUT_ENV, "")
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_IMPORT_TIMEOUT_S
    return value if 0 < value < 1e6 else DEFAULT_IMPORT_TIMEOUT_S


_CHILD_PROBE: str | None = None     # "" (imports) or the line saying it blocked, once per process


def import_blocks() -> str | None:
    """`import torch, torch_npu` tried in a child process (its own session) bounded by import_timeout_s():
    None when it finished (worked or failed: the in-process import then says how), else one line saying
    it timed out. A Ctrl-C or SIGTERM meanwhile stops the child too. Inside the npu stand-in (whose
    torch_npu is its own) and in a child of a process whose probe finished, nothing is tried."""
    global _CHILD_PROBE
    if _CHILD_PROBE is not None:
        return _CHILD_PROBE or None
    if os.environ.get("NPU_STANDIN") in ("cpu", "cuda") or os.environ.get(_PROBED_ENV) == sys.executable:
        _CHILD_PROBE = ""
        return None
    import signal

    timeout = import_timeout_s()
    env = {k: v for k, v in os.environ.items() if k != _PROBED_ENV}
    proc = subprocess.Popen([sys.executable, "-c", "import torch, torch_npu"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _CHILD_PROBE = (f"{STATUS_TIMED_OUT} after {timeout:g} s (a blocked driver or device? "
                        f"{IMPORT_TIMEOUT_ENV} sets the bound)")
        return _CHILD_PROBE
    finally:
        if proc.poll() is None:        # timed out, or Ctrl-C / SIGTERM while waiting: the child's group goes
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
    _CHILD_PROBE = ""
    if proc.returncode == 0:
        os.environ[_PROBED_ENV] = sys.executable
    return None


def _is_missing_cann(exc: BaseException) -> bool:
    for err in exception_chain(exc):
        if not isinstance(err, (ImportError, OSError)):
            continue
        msg = str(err)
        if _CANN_LIB_RE.search(msg) and any(m in msg for m in _MISSING_LIB_MARKERS):
            return True
    return False


_NPU_PROBE: dict | None = None
_PROBING = False   # probe_torch_npu() is importing torch: import_torch() must not probe again


def probe_torch_npu(refresh: bool = False) -> dict:
    """Whether torch_npu is installed and importable, without letting its failure escape.

    Returns {"installed", "importable", "version", "status", "error"} where status is one of
    "torch_npu not installed", "torch_npu present, CANN runtime not found",
    "torch_npu import failed: <short reason>" or "ok". The import is attempted once per process
    (cached; `refresh=True` tries again).
    """
    global _NPU_PROBE
    if _NPU_PROBE is not None and not refresh:
        return dict(_NPU_PROBE)
    version = dist_version("torch_npu", "torch-npu")
    installed = version is not None or torch_npu_installed()
    result = {"installed": installed, "importable": False, "version": version,
              "status": STATUS_NOT_INSTALLED, "error": None}
    blocked = import_blocks() if installed and "torch_npu" not in sys.modules else None
    if blocked:        # never imported here: it would hang this process
        result.update(status=blocked, error=blocked)
        _block_torch_npu()
    elif installed:
        if "torch_npu" in sys.modules and sys.modules["torch_npu"] is None:
            del sys.modules["torch_npu"]     # refresh: try the real import again
        global _PROBING
        try:
            _PROBING = True
            try:
                import_torch()
            finally:
                _PROBING = False
            # A failed `import torch_npu` leaves TORCH_DEVICE_BACKEND_AUTOLOAD=0 behind in
            # os.environ (torch_npu sets it on entry and restores it only on success): restore.
            saved = os.environ.get(AUTOLOAD_ENV)
            try:
                torch_npu = importlib.import_module("torch_npu")
            finally:
                if saved is None:
                    os.environ.pop(AUTOLOAD_ENV, None)
                else:
                    os.environ[AUTOLOAD_ENV] = saved
        except Exception as exc:
            result["error"] = short_error(exc)
            if _is_missing_cann(exc):
                result["status"] = STATUS_NO_CANN
            else:
                result["status"] = f"{STATUS_IMPORT_FAILED}: {result['error']}"
            _block_torch_npu()
        else:
            result["importable"] = True
            result["status"] = STATUS_OK
            if result["version"] is None:
                result["version"] = getattr(torch_npu, "__version__", None)
    _NPU_PROBE = dict(result)
    return result


def _block_torch_npu() -> None:
    """After a failed `import torch_npu`, later imports of it fail cleanly with ImportError, as if it
    were not installed: transformers' `is_torch_npu_available()` imports torch_npu unguarded when the
    package is present, so without CANN every `import transformers` would die on libhccl.so.
    The environment still reports what was found (the probe result above)."""
    for name in [m for m in sys.modules if m == "torch_npu" or m.startswith("torch_npu.")]:
        del sys.modules[name]
    sys.modules["torch_npu"] = None   # `import torch_npu` -> ModuleNotFoundError


_RELEASE_RE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def _release(version: str | None) -> tuple[int, int, int] | None:
    if not version:
        return None
    m = _RELEASE_RE.match(str(version).split("+", 1)[0])
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def torch_pair_ok(torch_version: str | None, torch_npu_version: str | None) -> bool | None:
    """Whether torch and torch_npu form a supported pair: same major.minor.patch.

    torch_npu versions look like "2.6.0.post1", "2.1.0.post10", "2.13.0"; torch's local part
    ("+cpu") is ignored. None when torch_npu is absent; False when either cannot be parsed.
    """
    if not torch_npu_version:
        return None
    a, b = _release(torch_version), _release(torch_npu_version)
    if a is None or b is None:
        return False
    return a == b



# ---------------------------------------------------------------------------------------------
# the device
# ---------------------------------------------------------------------------------------------


def device_problem(torch) -> str | None:
    """None when an NPU can be used, else a short description of why not."""
    probe = probe_torch_npu()
    if probe["status"] != STATUS_OK:
        return probe["status"]
    npu = getattr(torch, "npu", None)
    try:
        if npu is None or not npu.is_available():
            return "torch_npu found no NPU (torch.npu.is_available() is False)"
        if npu.device_count() <= 0:
            return "torch_npu found no NPU (torch.npu.device_count() is 0)"
    except Exception as exc:
        return f"torch.npu failed: {short_error(exc)}"
    return None


def device_hint(problem: str) -> str:
    if problem == STATUS_NO_CANN:
        return "install CANN and source set_env.sh, or use --device cpu"
    if problem == STATUS_NOT_INSTALLED:
        return "install torch_npu matching your torch version (and CANN), or use --device cpu"
    if problem.startswith("torch_npu found no NPU"):
        return "check the driver with npu-smi info and ASCEND_RT_VISIBLE_DEVICES, or use --device cpu"
    return "fix the torch_npu / CANN install, or use --device cpu"


def record_device(torch, kind: str, index: int | None, env: dict) -> None:
    """The environment record's facts about the NPU in use, from torch_npu (completes npu-smi's).
    The memory is this rank's card only (see engine.backends.cuda.record_device for accelerate's)."""
    if kind != "npu":
        return
    idx = index if index is not None else 0
    try:
        name = torch.npu.get_device_name(idx)
        # More precise than npu-smi on A3, where npu-smi prints just "Ascend910".
        if name:
            env["npu_model"] = _normalise_npu_name(str(name))
    except Exception:
        pass
    if not env["num_chips"]:
        # npu-smi is often missing inside containers; count the visible logical devices.
        try:
            env["num_chips"] = int(torch.npu.device_count())
            env["num_cards"] = env["num_cards"] or env["num_chips"]
        except Exception:
            pass
    try:
        env["device_memory_bytes"] = int(torch.npu.mem_get_info(idx)[1])
    except Exception:
        env["device_memory_bytes"] = None
    if env["cann_version"] is None:
        try:
            from torch_npu.npu.utils import get_cann_version

            env["cann_version"] = str(get_cann_version()) or None
        except Exception:
            pass


BACKEND = Backend("npu", LABEL, device_problem, device_hint, record_device)
