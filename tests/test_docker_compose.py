"""docker-compose.yml checked statically (no Docker engine on CI machines)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from config.settings import ServerSettings

REPO = Path(__file__).resolve().parents[1]


def load() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_services_build_from_the_dockerfile():
    compose = load()
    services = compose["services"]
    assert set(services) == {"h2o-server", "h2o-server-cuda"}
    dockerfile = (REPO / "Dockerfile").read_text()
    assert 'CMD ["h2o-server", "serve"]' in dockerfile
    for service in services.values():
        assert service["build"]["context"] == "."
        assert service["build"]["args"]["MLX_BACKEND"] in ("cpu", "cuda13")
        for src in re.findall(r"^COPY (\S+)", dockerfile, re.M):
            assert (REPO / src).exists(), f"Dockerfile copies missing {src}"
    assert services["h2o-server-cuda"]["profiles"] == ["cuda"]
    devices = services["h2o-server-cuda"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]


def test_healthcheck_ports_volumes_and_settings():
    compose = load()
    fields = {f"H2O_{name.upper()}" for name in ServerSettings.model_fields}
    for service in compose["services"].values():
        check = " ".join(service["healthcheck"]["test"])
        assert "/health" in check and ":8000" in check
        assert all(port.endswith(":8000") for port in service["ports"])
        assert set(service["environment"]) <= fields  # every variable is a real setting
        mounts = {v.split(":")[1] for v in service["volumes"]}
        assert mounts == {"/models", "/data/sessions"}
        assert service["environment"]["H2O_SPILL_DIR"] == "/data/sessions"
        for volume in service["volumes"]:
            assert volume.split(":")[0] in compose["volumes"]
