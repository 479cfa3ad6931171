"""Where rfedray keeps things outside a run directory: its packaged configurations and the user's
cache and data folders.

The configurations of ``configs/`` travel inside the package (``rfedray/configs``), so an installed
rfedray runs ``rfedray run eeg_physionet_spdnet.yaml`` from any folder, and ``rfedray config init``
copies them out for editing. Caches (preprocessed EEG) and downloaded data go to the platform's
user folders (``platformdirs``: ``~/.cache/rfedray`` and ``~/.local/share/rfedray`` on Linux), never
into the installed package; ``RFEDRAY_CACHE_DIR`` and ``RFEDRAY_DATA_DIR`` move them.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Optional

import platformdirs

APP = "rfedray"


def packaged_configs() -> dict[str, Path]:
    """The configurations shipped with rfedray, by file name (``fedpca.yaml``: its path)."""
    folder = resources.files(APP) / "configs"
    if not folder.is_dir():
        return {}
    return {entry.name: Path(str(entry)) for entry in sorted(folder.iterdir(), key=lambda e: e.name)
            if entry.name.endswith(".yaml")}


def packaged_config(name: str) -> Optional[Path]:
    """The packaged configuration called ``name`` (``fedpca`` or ``fedpca.yaml``), or None."""
    configs = packaged_configs()
    return configs.get(name) or configs.get(f"{name}.yaml")


def cache_dir() -> Path:
    """``RFEDRAY_CACHE_DIR``, else the platform's user cache folder for rfedray."""
    return Path(os.environ.get("RFEDRAY_CACHE_DIR", "") or platformdirs.user_cache_path(APP)).expanduser()


def data_dir() -> Path:
    """``RFEDRAY_DATA_DIR``, else the platform's user data folder for rfedray."""
    return Path(os.environ.get("RFEDRAY_DATA_DIR", "") or platformdirs.user_data_path(APP)).expanduser()
