"""What this machine offers: a CUDA GPU, or the CPU (with the Triton interpreter if enabled)."""
from __future__ import annotations

import os
import platform
import subprocess
from datetime import datetime, timezone

import torch


def has_gpu() -> bool:
    return torch.cuda.is_available()


def targets() -> frozenset[str]:
    """``{"cuda"}`` on a GPU machine; else ``{"cpu"}`` plus ``"interpret"`` under TRITON_INTERPRET=1."""
    if has_gpu():
        return frozenset({"cuda"})
    if os.environ.get("TRITON_INTERPRET") == "1":
        return frozenset({"cpu", "interpret"})
    return frozenset({"cpu"})


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if has_gpu() else torch.device("cpu")


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:
        return "not installed"


def _git_sha() -> str:
    """The checkout's commit, with "+dirty" when tracked files differ from it (a copied tree)."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=here, text=True, capture_output=True,
                              timeout=5).stdout.strip()

    try:
        sha = git("rev-parse", "--short", "HEAD")
        if not sha:
            return "unknown"
        return sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:
        return "unknown"


def driver_version() -> str:
    """The NVIDIA driver's version, as nvidia-smi reports it ("not recorded" without it)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             text=True, capture_output=True, timeout=10).stdout.split()
    except Exception:
        return "not recorded"
    return out[0] if out else "not recorded"


def metadata() -> dict[str, str]:
    """Machine-readable provenance for every result row."""
    gpu = torch.cuda.get_device_name() if has_gpu() else "none (CPU)"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cupy": _version("cupy"),
        "python": platform.python_version(),
        "git_sha": _git_sha(),
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
