"""A model's identity by content: what the fleet KV tier checks before trusting KV.

Two workers may share KV only if they would compute the same KV: the same config, the
same weights, the same dtype. The served name proves none of that (one name may be
redeployed with new weights), so the fingerprint hashes the files themselves: config.json
and every safetensors file, byte for byte, plus the dtype the engine runs in.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_CHUNK = 8 * 1024 * 1024


def model_fingerprint(model_dir: str | Path, dtype: str) -> str:
    """BLAKE2b-128 (hex) of config.json, the safetensors files (by name, in order) and
    ``dtype``. Reads every weight byte once: about a second per GB here."""
    model_dir = Path(model_dir)
    digest = hashlib.blake2b(digest_size=16)
    files = [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            while block := f.read(_CHUNK):
                digest.update(block)
    digest.update(b"dtype:" + dtype.encode())
    return digest.hexdigest()
