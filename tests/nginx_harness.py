"""Run deploy/nginx.conf on loopback in front of given ports, as an unprivileged test can.

The shipped file is used as is, except its `listen` line and its one upstream
`server` line, which become a loopback port and one line per replica port (with
the same health-check parameters). Logs, pid and temp files live in a test folder.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "deploy" / "nginx.conf"
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
MISSING = "nginx is not installed (Debian: apt-get install nginx-light; `make setup` as root)"

MAIN = """worker_processes 1;
{user}error_log {dir}/error.log notice;
pid {dir}/nginx.pid;
events {{ worker_connections 512; }}
http {{
    access_log {dir}/access.log;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    include {dir}/replicas.conf;
}}
"""


def render(ports: list[int], listen: int, folder: Path) -> Path:
    """Write nginx.conf (+ replicas.conf, the shipped file rewritten) into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    text = SHIPPED.read_text()
    server = re.search(r"^(\s*)server replica:8000( [^;]*)?;$", text, re.M)
    assert server, "deploy/nginx.conf has no `server replica:8000 ...;` line"
    indent, params = server.group(1), server.group(2) or ""
    lines = "\n".join(f"{indent}server 127.0.0.1:{p}{params};" for p in ports)
    text = text[: server.start()] + lines + text[server.end() :]
    text, n = re.subn(r"^(\s*)listen 8080;$", rf"\1listen 127.0.0.1:{listen};", text, flags=re.M)
    assert n == 1, "deploy/nginx.conf has no `listen 8080;` line"
    (folder / "replicas.conf").write_text(text)
    # As root the workers would switch to `nobody`, who cannot enter a private tmp folder.
    user = "user root;\n" if os.geteuid() == 0 else ""
    conf = folder / "nginx.conf"
    conf.write_text(MAIN.format(dir=folder, user=user))
    return conf


class Nginx:
    def __init__(self, ports: list[int], folder: Path):
        from bench.local_server import free_port

        self.folder, self.port = folder, free_port()
        conf = render(ports, self.port, folder)
        self.process = subprocess.Popen(
            [NGINX, "-p", str(folder), "-c", str(conf), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=open(folder / "stderr.log", "w"),
        )
        deadline = time.monotonic() + 20
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"nginx exited: {self.errors()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                assert time.monotonic() < deadline, f"nginx did not start: {self.errors()}"
                time.sleep(0.05)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def errors(self) -> str:
        logs = [self.folder / "stderr.log", self.folder / "error.log"]
        return "\n".join(p.read_text() for p in logs if p.exists())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)  # graceful: finish open requests
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
