"""Where the CPU kernels' build lives (worker/host/cpu_kernels.py): named for the ninja that
builds it, which is the Python environment's own whatever PATH says, so processes started
with different PATHs share one build instead of redoing each other's."""

from __future__ import annotations

import os
import sys

import worker.host.cpu_kernels as loader


def _fake_ninja(folder):
    folder.mkdir()
    ninja = folder / "ninja"
    ninja.write_text("#!/bin/sh\necho 1.0.0\n")
    ninja.chmod(0o755)
    return ninja


def test_the_environment_s_own_ninja_builds_whatever_path_says(tmp_path, monkeypatch):
    own = _fake_ninja(tmp_path / "venv-bin")
    monkeypatch.setattr(sys, "executable", str(own.parent / "python"))
    key = loader._build_key()
    other = _fake_ninja(tmp_path / "elsewhere")
    monkeypatch.setenv("PATH", os.pathsep.join([str(other.parent), os.environ["PATH"]]))
    assert loader._ninja() == str(own)
    assert loader._build_key() == key  # the same build, whichever ninja PATH finds first


def test_a_build_is_named_for_its_ninja(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-ninja-here" / "python"))
    on_path = loader._build_key()  # no ninja beside Python: the first on PATH
    own = _fake_ninja(tmp_path / "venv-bin")
    monkeypatch.setattr(sys, "executable", str(own.parent / "python"))
    assert loader._build_key() != on_path


def test_the_build_s_ninja_is_first_on_path_only_while_it_builds(tmp_path):
    before = os.environ["PATH"]
    ninja = _fake_ninja(tmp_path / "bin")
    with loader._first_on_path(str(ninja)):
        assert os.environ["PATH"].split(os.pathsep)[0] == str(ninja.parent)
    assert os.environ["PATH"] == before
