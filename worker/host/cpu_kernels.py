"""The CPU kernels (worker/host/csrc/), built once per machine: decode attention over the
paged cache, a decode step's layers in one call, the packed and skinny matmuls of small
batches, and the sampler's filter-and-draw.

    python -m worker.host.cpu_kernels               # build them now, waiting for the build
    python -m worker.host.cpu_kernels --background  # start their build in the background

torch's C++ extension loader compiles them into torch's extensions folder
(``$TORCH_EXTENSIONS_DIR``, by default under ``~/.cache``) and loads the cached build
afterwards. The build is named by a hash of the source, its path, the CPU's
instruction-set flags (it is compiled for the CPU it runs on) and the ninja that builds it,
so a shared cache never hands one CPU another's build. That ninja is the Python
environment's own (the ``ninja`` package) wherever it has one, whatever PATH says.

An engine never waits for the build (``engine_kernels``): where it is not built, the engine
serves on the torch path for its process's life while one background process per machine
builds it (worker/host/kernel_build.py), and the next start loads it. A direct user of the
kernels (``cpu_kernels``: a benchmark, a kernel's test, the command above) builds them, or
waits for the background build. Where they cannot be built (no C++ compiler, no ninja), or
with ``CONVEYOR_CPU_KERNELS=0``, every function here returns None, says why once in the
log, and the engine keeps to torch ops: the same results, slower (a sampled draw is the
same definition, summed in another order: where it lands within rounding of a token
boundary, the neighbouring token may be picked).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import structlog

from producer import settings
from worker.host.kernel_build import (
    FAILED_STATE,
    READY,
    STARTED,
    BuildFolder,
    start_in_background,
)

log = structlog.get_logger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("paged_decode.cpp", "decode_layers.cpp",
                                         "skinny_linear.cpp", "packed_linear.cpp", "linear.cpp",
                                         "sample_rows.cpp", "argmax_rows.cpp", "penalize.cpp",
                                         "mask_rows.cpp", "thread_placement.cpp",
                                         "step_team.cpp", "bindings.cpp")]
HEADERS = [CSRC / name for name in ("kernels.h", "paged_attention.h", "skinny_linear.h",
                                         "packed_linear.h", "linear.h", "vec.h",
                                         "each_task.h", "step_team.h", "tensor_api.h")]

# The builder process's niceness: an engine serving on the torch path meanwhile goes first.
BUILDER_NICENESS = 10
BACKGROUND_FLAG = "--build-holding-lock"

_lock = threading.Lock()
_loaded: dict[str, Any] = {}
_engines_wait = False


def enabled() -> bool:
    """Whether the kernels may be used (producer.settings.cpu_kernels)."""
    return settings.cpu_kernels()


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


def mask_rows_kernel() -> Any | None:
    """The compiled ``mask_rows`` function (structured outputs' token masks in place on
    float32 CPU logits), or None where the kernels are switched off or cannot be built."""
    module = cpu_kernels()
    return None if module is None else module.mask_rows


def cpu_kernels() -> Any | None:
    """The compiled module (csrc/bindings.cpp names what it holds), or None where the kernels
    are switched off or cannot be built (logged once). The first call in a process builds
    them where nothing has (waiting for a build another process runs), unless an engine
    started first and found them not built: then None for the process's life."""
    if not enabled():
        return None
    with _lock:
        if "module" not in _loaded:
            _loaded["module"] = _build_now()
        return _loaded["module"]


def engine_kernels() -> Any | None:
    """The kernels for an engine starting now, without waiting for a build: the module where
    one is built (or loaded here already), else None, and this process keeps to the torch
    path for its life (a running request's sampled numbers must not change mid-run) while
    one background process per machine builds them for the next start. In a process that
    called ``engines_wait_for_build()`` (the tests) it is ``cpu_kernels()``."""
    if not enabled():
        return None
    with _lock:
        if "module" not in _loaded:
            _loaded["module"] = _build_now() if _engines_wait else _load_or_start_build()
        return _loaded["module"]


def engines_wait_for_build() -> None:
    """Make this process's engines build (or wait for) the kernels when they start, as
    ``cpu_kernels()`` does: a test session's engines must not quietly serve on torch."""
    global _engines_wait
    _engines_wait = True


def start_background_build() -> str:
    """Where the build stands (kernel_build's READY, FAILED_STATE, BUILDING or STARTED), the
    build started in a background process where nobody runs it; "off" where switched off.
    Loads no torch and never waits (the demo calls it before anything else)."""
    if not enabled():
        return "off"
    return start_in_background(build_folder(), _spawn_builder)


def wait_for_build() -> bool:
    """Wait for a build another process runs, without loading it; whether the kernels are
    built now."""
    folder = build_folder()
    os.close(folder.lock())
    return folder.built()


def build_folder() -> BuildFolder:
    """The build folder of these sources on this CPU, under torch's extensions folder."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return BuildFolder(Path(root) / _module_name())


def _load_or_start_build() -> Any | None:
    folder = build_folder()
    state = start_in_background(folder, _spawn_builder)
    if state == READY:
        module = _build_now()
        log.info("CPU kernels built: serving with them" if module is not None else
                 "CPU kernels did not load; serving on the torch path")
        return module
    if state == FAILED_STATE:
        log.warning("cpu kernels unavailable; decodes use torch ops",
                    error=_first_line(folder.failure() or ""))
        return None
    log.warning("CPU kernels building in the background; serving on the torch path",
                build_log=str(folder.log), started_here=state == STARTED)
    return None


def _build_now() -> Any | None:
    """Build (or load) the kernels in this process, waiting for a build elsewhere first."""
    folder = build_folder()
    fd = folder.try_lock()
    if fd is None:
        log.info("waiting for the CPU kernels' build in another process", log=str(folder.log))
        fd = folder.lock()
    try:
        return _build_locked(folder)
    finally:
        os.close(fd)


def _build_locked(folder: BuildFolder) -> Any | None:
    """Build (or load) the kernels, the build lock held, marking the folder built or failed."""
    try:
        return folder.build_under_lock(lambda: _compile(folder.path))
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch path"
        log.warning("cpu kernels unavailable; decodes use torch ops",
                    error=f"{type(exc).__name__}: {_first_line(str(exc))}")
        return None


def _compile(folder: Path) -> Any:
    from torch.utils import cpp_extension

    _clear_torch_lock(folder)
    started = time.monotonic()
    with _first_on_path(_ninja()):
        module = cpp_extension.load(
            folder.name, [str(p) for p in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
            build_directory=str(folder), verbose=False)
    log.debug("cpu kernels ready", seconds=round(time.monotonic() - started, 1))
    return module


def _spawn_builder(lock_fd: int) -> None:
    """A detached process that builds the kernels holding ``lock_fd``'s lock (inherited: it
    ends with the process), at low priority so that serving keeps the cores first."""
    folder = build_folder()
    with open(folder.log, "wb") as out:
        subprocess.Popen(
            [sys.executable, "-m", "worker.host.cpu_kernels", BACKGROUND_FLAG],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            pass_fds=(lock_fd,), start_new_session=True, preexec_fn=_lower_priority)


def _lower_priority() -> None:
    os.nice(BUILDER_NICENESS)


def _module_name() -> str:
    return f"conveyor_cpu_kernels_{_build_key()}"


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


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


def _clear_torch_lock(folder: Path) -> None:
    """Remove torch's own build lock, left by a build that died: under ours nobody else
    builds, and torch would wait on it forever."""
    lock = folder / "lock"
    if lock.exists():
        lock.unlink(missing_ok=True)
        log.warning("removed a build lock a dead build left", path=str(lock))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == [BACKGROUND_FLAG]:  # the builder _spawn_builder starts: it holds the lock
        module = _build_locked(build_folder()) if enabled() else None
    elif args == ["--background"]:
        print(f"cpu kernels: {start_background_build()} (log: {build_folder().log})")
        return 0
    else:
        module = cpu_kernels()
    print("cpu kernels: " + ("ready" if module is not None else
                             "unavailable (decodes use torch ops)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
