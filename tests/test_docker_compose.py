"""docker-compose.yml checked statically (no Docker engine on CI machines)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from config.settings import ServerSettings

REPO = Path(__file__).resolve().parents[1]
SERVERS = ("h2o-server", "h2o-server-cuda", "replica")


def load() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def seconds(duration: str) -> float:
    units = {"s": 1, "m": 60}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([sm])", duration))


def test_services_build_from_the_dockerfile():
    compose = load()
    services = compose["services"]
    assert set(services) == {*SERVERS, "router"}
    dockerfile = (REPO / "Dockerfile").read_text()
    assert 'CMD ["h2o-server", "serve"]' in dockerfile
    for name in SERVERS:
        service = services[name]
        assert service["build"]["context"] == "."
        assert service["build"]["args"]["MLX_BACKEND"] in ("cpu", "cuda13")
        copied = re.findall(r"^COPY (\S+)", dockerfile, re.M)
        for src in copied:
            assert (REPO / src).exists(), f"Dockerfile copies missing {src}"
        listed = re.search(
            r"^packages = \[(.*?)\]", (REPO / "pyproject.toml").read_text(), re.M | re.S
        )
        packages = {p.split(".")[0] for p in re.findall(r'"([\w.]+)"', listed.group(1))}
        assert packages <= set(copied), f"the image lacks {packages - set(copied)}"
    assert services["h2o-server-cuda"]["profiles"] == ["cuda"]
    devices = services["h2o-server-cuda"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]


def test_healthcheck_ports_volumes_and_settings():
    compose = load()
    fields = {f"H2O_{name.upper()}" for name in ServerSettings.model_fields}
    for name in SERVERS:
        service = compose["services"][name]
        check = " ".join(service["healthcheck"]["test"])
        assert "/health" in check and ":8000" in check
        assert all(port.endswith(":8000") for port in service.get("ports", []))
        assert set(service["environment"]) <= fields  # every variable is a real setting
        mounts = {v.split(":")[1] for v in service["volumes"]}
        assert mounts == {"/models", "/data/sessions"}
        assert service["environment"]["H2O_SPILL_DIR"] == "/data/sessions"
        for volume in service["volumes"]:
            assert volume.split(":")[0] in compose["volumes"]


def test_replicas_scale_behind_nginx_and_share_one_spill_volume():
    services = load()["services"]
    replica, router = services["replica"], services["router"]
    assert replica["profiles"] == router["profiles"] == ["replicas"]
    assert "ports" not in replica and replica["expose"] == ["8000"]  # --scale needs no host port
    assert "sessions:/data/sessions" in replica["volumes"]
    assert "sessions:/data/sessions" in services["h2o-server"]["volumes"]  # the same volume
    env = replica["environment"]
    assert float(env["H2O_SPILL_IDLE_SECONDS"].split(":-")[1].rstrip("}")) > 0
    drain = float(env["H2O_SHUTDOWN_TIMEOUT"].split(":-")[1].rstrip("}"))
    assert seconds(replica["stop_grace_period"]) > drain  # SIGKILL only after the drain
    assert router["depends_on"]["replica"]["condition"] == "service_healthy"

    mount = next(v for v in router["volumes"] if v.endswith("/etc/nginx/conf.d/default.conf:ro"))
    conf = (REPO / mount.split(":")[0]).read_text()
    assert re.search(r"^\s*server replica:8000\b", conf, re.M)  # the service and its port
    (port,) = router["ports"]
    assert port.endswith(":8080") and re.search(r"^\s*listen 8080;", conf, re.M)
    assert re.search(r"^\s*hash \$h2o_session consistent;", conf, re.M)
