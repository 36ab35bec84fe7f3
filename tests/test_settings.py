"""The environment switches (producer/settings.py): defaults, new names, renamed ones.

Each accessor reads the environment when called, so these tests set variables with
monkeypatch; the table in docs/settings.md lists every one of them.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from producer import settings
from worker.host import cpu_kernels
from worker.models import linear, native_decode, packed_weights

ROOT = Path(__file__).resolve().parents[1]
OLD_KERNELS = "CONVEYOR_CPU_ATTENTION_KERNEL"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No CONVEYOR_* variable set, and no renamed one warned about yet in this process."""
    for setting in settings.SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
        if setting.old_name:
            monkeypatch.delenv(setting.old_name, raising=False)
    monkeypatch.setattr(settings, "_warned", set())


def deprecations(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


def test_every_setting_has_its_default_when_unset():
    assert settings.home() is None
    assert settings.redis_url() is None
    assert settings.batch_publisher() is False
    assert settings.fault_kill_on_token() is None
    assert settings.cpu_kernels() is True
    assert settings.cpu_matmul() == "packed"
    assert settings.cpu_decode_layers() is True
    assert settings.cpu_step_team() is True


def test_each_setting_is_read_when_asked_not_at_import(monkeypatch, tmp_path):
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path))
    monkeypatch.setenv("CONVEYOR_REDIS_URL", "redis://h:1/0")
    monkeypatch.setenv("CONVEYOR_BATCH_PUBLISHER", "yes")
    monkeypatch.setenv("CONVEYOR_FAULT_KILL_ON_TOKEN", "999")
    monkeypatch.setenv("CONVEYOR_CPU_MATMUL", " BLAS ")
    monkeypatch.setenv("CONVEYOR_CPU_DECODE_LAYERS", "off")
    monkeypatch.setenv("CONVEYOR_CPU_STEP_TEAM", "0")
    assert settings.home() == tmp_path
    assert settings.redis_url() == "redis://h:1/0"
    assert settings.batch_publisher() is True
    assert settings.fault_kill_on_token() == 999
    assert settings.cpu_matmul() == "blas"
    assert settings.cpu_decode_layers() is False
    assert settings.cpu_step_team() is False


def test_an_unknown_matmul_mode_is_the_default(monkeypatch):
    monkeypatch.setenv("CONVEYOR_CPU_MATMUL", "fastest")
    assert settings.cpu_matmul() == "packed"


def test_the_modules_that_switch_ask_the_settings(monkeypatch):
    monkeypatch.setenv("CONVEYOR_CPU_MATMUL", "unpacked")
    monkeypatch.setenv("CONVEYOR_CPU_DECODE_LAYERS", "0")
    monkeypatch.setenv("CONVEYOR_CPU_STEP_TEAM", "0")
    assert not packed_weights.enabled() and not linear.blas_only()
    assert not native_decode.enabled() and not native_decode.team_enabled()
    monkeypatch.setenv("CONVEYOR_CPU_MATMUL", "blas")
    assert linear.blas_only()


def test_the_kernels_switch_turns_off_every_cpu_kernel(monkeypatch):
    monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "0")
    assert not cpu_kernels.enabled()
    assert cpu_kernels.cpu_kernels() is None
    assert [get() for get in (cpu_kernels.paged_decode_kernel, cpu_kernels.decode_layers_kernel,
                              cpu_kernels.sample_rows_kernel, cpu_kernels.argmax_rows_kernel,
                              cpu_kernels.penalize_kernel)] == [None] * 5


def test_the_new_kernels_name_warns_nothing(monkeypatch):
    monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert settings.cpu_kernels() is False
    assert deprecations(caught) == []


def test_the_old_kernels_name_still_works_and_warns_once(monkeypatch):
    monkeypatch.setenv(OLD_KERNELS, "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [settings.cpu_kernels() for _ in range(3)] == [False] * 3
        assert cpu_kernels.cpu_kernels() is None
    [message] = deprecations(caught)
    assert OLD_KERNELS in message and "CONVEYOR_CPU_KERNELS" in message


def test_the_new_name_wins_where_both_are_set(monkeypatch):
    monkeypatch.setenv(OLD_KERNELS, "0")
    monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert settings.cpu_kernels() is True
    assert len(deprecations(caught)) == 1  # the old name is still worth a word


def test_an_override_lasts_for_its_block(monkeypatch):
    monkeypatch.setenv("CONVEYOR_CPU_DECODE_LAYERS", "1")
    with settings.overridden(settings.CPU_DECODE_LAYERS, "0"):
        assert settings.cpu_decode_layers() is False
    assert settings.cpu_decode_layers() is True
    with settings.overridden(settings.CPU_STEP_TEAM, "0"):
        assert settings.cpu_step_team() is False
    assert settings.cpu_step_team() is True


def _table_rows() -> dict[str, list[str]]:
    rows = {}
    for line in (ROOT / "docs" / "settings.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `CONVEYOR_"):
            rows[cells[0].strip("`")] = cells
    return rows


def test_the_docs_table_lists_every_setting_with_its_default_and_old_name():
    rows = _table_rows()
    for setting in settings.SETTINGS:
        name, default, _, old = rows[setting.name]
        assert setting.default in default or setting.default == "", setting.name
        assert old == (f"`{setting.old_name}`" if setting.old_name else ""), setting.name


def test_every_conveyor_variable_the_docs_mention_is_in_the_table():
    known = set(_table_rows()) | {s.old_name for s in settings.SETTINGS if s.old_name}
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    mentioned = {name for page in pages
                 for name in re.findall(r"CONVEYOR_[A-Z_]*[A-Z]", page.read_text())}
    assert mentioned - known == set()
