"""Where conveyor keeps its local data (models it makes, the embedded Redis)."""

from __future__ import annotations

import os
from pathlib import Path

from producer import settings


def data_dir() -> Path:
    """``$CONVEYOR_HOME``, else ``$XDG_DATA_HOME/conveyor``, else ``~/.local/share/conveyor``."""
    if home := settings.home():
        return home
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(xdg) / "conveyor"


def default_model_dir(preset: str = "small") -> Path:
    """Where `conveyor make-model` puts a preset model when no folder is given."""
    return data_dir() / "models" / preset
