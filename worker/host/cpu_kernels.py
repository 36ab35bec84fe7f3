"""The CPU kernels (worker/host/csrc/), built on first use: decode attention over the paged
cache, a decode step's layers in one call, the packed and skinny matmuls of small batches,
and the sampler's filter-and-draw.

    python -m worker.host.cpu_kernels      # build them now (scripts/setup.sh does)

torch's C++ extension loader compiles them once per machine into torch's extensions folder
(``$TORCH_EXTENSIONS_DIR``, by default under ``~/.cache``) and loads the cached build
afterwards. The build is named by a hash of the source, its path, the CPU's
instruction-set flags (it is compiled for the CPU it runs on) and the ninja that builds it,
so a shared cache never hands one CPU another's build. That ninja is the Python
environment's own (the ``ninja`` package) wherever it has one, whatever PATH says. A CPU
engine loads it when it starts, not in its first step. Where it cannot be built (no C++
compiler, no ninja), or with ``CONVEYOR_CPU_ATTENTION_KERNEL=0``, every function here
returns None, says why once in the log, and the engine keeps to torch ops: the same
results, slower (a sampled draw is the same definition, summed in another order: where it
lands within rounding of a token boundary, the neighbouring token may be picked).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("paged_decode.cpp", "decode_layers.cpp",
                                         "skinny_linear.cpp", "packed_linear.cpp", "linear.cpp",
                                         "sample_rows.cpp", "argmax_rows.cpp", "penalize.cpp",
                                         "thread_placement.cpp", "step_team.cpp", "bindings.cpp")]
HEADERS = [CSRC / name for name in ("kernels.h", "paged_attention.h", "skinny_linear.h",
                                         "packed_linear.h", "linear.h", "vec.h",
                                         "each_task.h", "step_team.h")]
ENV_SWITCH = "CONVEYOR_CPU_ATTENTION_KERNEL"
# A build lock older than this was left by a build that died: torch would wait on it forever.
STALE_LOCK_S = 600.0

_lock = threading.Lock()
_loaded: dict[str, Any] = {}


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def paged_decode_kernel() -> Any | None:
    """The compiled ``paged_decode`` function, or None where it is switched off or cannot
    be built (logged once)."""
    module = cpu_kernels()
    return None if module is None else module.paged_decode


def decode_layers_kernel() -> Any | None:
    """The compiled ``decode_layers`` function (every layer of a decode-only step), or None
    where the kernels are switched off or cannot be built."""
    module = cpu_kernels()
    return None if module is None else module.decode_layers


def sample_rows_kernel() -> Any | None:
    """The compiled ``sample_rows`` function (the sampler's filter-and-draw for float32
    CPU logits), or None where the kernels are switched off or cannot be built."""
    module = cpu_kernels()
    return None if module is None else module.sample_rows


def argmax_rows_kernel() -> Any | None:
    """The compiled ``argmax_rows`` function (greedy picks of float32 CPU logits, as
    torch.argmax gives them), or None where the kernels are switched off or cannot be
    built."""
    module = cpu_kernels()
    return None if module is None else module.argmax_rows


def penalize_kernel() -> Any | None:
    """The compiled ``penalize`` function (repetition, presence and frequency penalties in
    place on float32 CPU logits), or None where the kernels are switched off or cannot be
    built."""
    module = cpu_kernels()
    return None if module is None else module.penalize


def cpu_kernels() -> Any | None:
    """The compiled module (csrc/bindings.cpp names what it holds), or None where the kernels
    are switched off or cannot be built (logged once)."""
    if not enabled():
        return None
    with _lock:
        if "module" not in _loaded:
            _loaded["module"] = _build()
        return _loaded["module"]


def _build() -> Any | None:
    try:
        from torch.utils import cpp_extension

        name = f"conveyor_cpu_kernels_{_build_key()}"
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
        folder = Path(root) / name
        folder.mkdir(parents=True, exist_ok=True)
        _clear_stale_lock(folder)
        started = time.monotonic()
        with _first_on_path(_ninja()):
            module = cpp_extension.load(
                name, [str(p) for p in SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                build_directory=str(folder), verbose=False)
        log.debug("cpu kernels ready", seconds=round(time.monotonic() - started, 1))
        return module
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch path"
        log.warning("cpu kernels unavailable; decodes use torch ops",
                    error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return None


def _build_key() -> str:
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.read_bytes())
    digest.update(_cpu_flags().encode())
    # The source's path too: torch rebuilds whenever the path in its build file changes, so
    # two checkouts sharing one build folder would rebuild each other's kernel forever.
    digest.update(str(CSRC.resolve()).encode())
    digest.update(str(_ninja()).encode())
    return digest.hexdigest()[:16]


def _ninja() -> str | None:
    """The ninja that builds the kernels: the Python environment's own where it has one.

    torch runs the first ``ninja`` on PATH, and ninja versions hash their build log's
    commands differently: a build made by the system's ninja read as "command line
    changed" to the virtual environment's (and back), and was redone from scratch, ~100 s,
    whenever a process with the other PATH loaded it.
    """
    own = Path(sys.executable).parent / "ninja"
    return str(own) if own.is_file() else shutil.which("ninja")


@contextmanager
def _first_on_path(program: str | None) -> Iterator[None]:
    """``program``'s folder first on PATH meanwhile (torch finds ninja by PATH alone)."""
    if program is None:
        yield
        return
    before = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(program).parent), before])
    try:
        yield
    finally:
        os.environ["PATH"] = before


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _clear_stale_lock(folder: Path) -> None:
    lock = folder / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
            log.warning("removed a stale build lock", path=str(lock))
    except FileNotFoundError:
        pass


def main() -> int:
    kernel = paged_decode_kernel()
    print("cpu kernels: " + ("ready" if kernel is not None else
                             "unavailable (decodes use torch ops)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
