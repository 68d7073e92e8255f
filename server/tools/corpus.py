"""The English evaluation text for perplexity runs, fetched once into an ignored data directory.

Source: the Lee background corpus (Lee, Pincombe & Welsh, 2005: 300 Australian Broadcasting
Corporation news articles, about 360 KB, ~75k SmolLM2 tokens) as shipped inside PyPI's gensim
wheel at ``gensim/test/test_data/lee_background.cor``. gensim is LGPL-2.1; we do not commit the
text, we download the pinned wheel through pip and extract that one file, checked by SHA-256.

    python -m server.tools.corpus        # prints the path, downloading on first use
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

GENSIM_REQUIREMENT = "gensim==4.4.0"
MEMBER = "gensim/test/test_data/lee_background.cor"
SHA256 = "5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb"
FILE_NAME = "lee_background.cor"


def data_dir() -> Path:
    """Where fetched data lives: $TURBOSERVE_DATA_DIR, else the checkout's ignored .data/."""
    override = os.environ.get("TURBOSERVE_DATA_DIR")
    return Path(override) if override else Path(__file__).resolve().parents[2] / ".data"


def lee_corpus_path(directory: Path | None = None) -> Path:
    """Path of the Lee corpus text, downloading and extracting it on first use."""
    target = (directory or data_dir()) / FILE_NAME
    if target.exists() and _sha256(target.read_bytes()) == SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    text = _extract_from_wheel()
    partial = target.with_suffix(".partial")
    partial.write_bytes(text)
    partial.replace(target)  # atomic: a concurrent reader never sees half a file
    return target


def _extract_from_wheel() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               GENSIM_REQUIREMENT, "-d", tmp]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("gensim-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {GENSIM_REQUIREMENT} to extract the Lee corpus "
                f"(`{' '.join(cmd)}` exited {proc.returncode}: {proc.stderr.strip()[-500:]}). "
                "Check network access to PyPI, or place lee_background.cor in "
                f"{data_dir()} (or set TURBOSERVE_DATA_DIR)."
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            text = wheel.read(MEMBER)
    if _sha256(text) != SHA256:
        raise RuntimeError(f"{MEMBER} in {wheels[0].name} does not have the expected SHA-256 {SHA256}")
    return text


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


if __name__ == "__main__":
    print(lee_corpus_path())
