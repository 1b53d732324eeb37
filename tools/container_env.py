"""Provide the container engine the container tests and the project's image need: Docker, its daemon, the images.

    uv run python tools/container_env.py up             # install Docker if missing, start its daemon, build the base image
    uv run python tools/container_env.py up --project   # ... and the project's image (the Dockerfile)
    uv run python tools/container_env.py up --harbor    # ... and what Harbor's Docker environment needs
    uv run python tools/container_env.py down           # stop the daemon `up` started (nothing else)
    uv run python tools/container_env.py check          # exit 1, naming the missing step, when something is absent

Steps, each skipped when already done:
1. the engine: Debian's ``docker.io`` (and ``debootstrap``) through apt-get, as root;
2. the daemon: ``dockerd`` started in the background when no ``docker info`` answers; its pid is kept in
   ``~/.cache/dew-ray/dockerd.pid`` (or ``$DEW_ENGINE_HOME/..``) so that ``down`` stops only the one ``up`` started;
3. the base image ``dew-ray/base:bookworm``: Debian bookworm (minbase, with python3) made by ``debootstrap`` and
   ``docker import``, so no registry is needed; cached by its tag;
4. with ``--project``, the project's image ``dew-ray/dew-ray:latest`` from the Dockerfile (Docker's layer cache
   makes a rebuild with unchanged dependencies take seconds);
5. with ``--harbor``, what Harbor 0.25's Docker environment (``dew_harbor.docker``) needs beyond Docker: the
   ``docker compose`` v2 and ``docker buildx`` plugins (Debian bookworm packages only Compose 1.29 and no buildx, so
   they come out of Debian trixie's ``docker-compose`` 2.26.1 and ``docker-buildx`` 0.13.1 packages, from Debian's
   own mirror).

``.ci/run`` runs ``up --project --harbor`` before the tests and ``down`` after them; the tests' own fixture runs the same
steps (``ensure``) and fails naming the step that could not be done, never skipping.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE_IMAGE = "dew-ray/base:bookworm"
PROJECT_IMAGE = "dew-ray/dew-ray:latest"
APT_SOURCES = (Path("/etc/apt/sources.list.d"), Path("/etc/apt/sources.list"))
# Docker CLI plugins Harbor drives, from Debian trixie's packages (bookworm has Compose 1.29 and no buildx).
PLUGINS = {
    "compose": "pool/main/d/docker-compose/docker-compose_2.26.1-4_amd64.deb",
    "buildx": "pool/main/d/docker-buildx/docker-buildx_0.13.1+ds1-3_amd64.deb",
}
PLUGIN_DIR = Path("/usr/local/lib/docker/cli-plugins")


def debian_mirror() -> str:
    """The Debian archive this machine's apt uses (``$DEW_DEBIAN_MIRROR`` first): debootstrap and the plugin
    packages come from where the machine already installs its packages, so no host is written here."""
    if os.environ.get("DEW_DEBIAN_MIRROR"):
        return os.environ["DEW_DEBIAN_MIRROR"].rstrip("/")
    files = [f for place in APT_SOURCES for f in (sorted(place.glob("*.sources")) + sorted(place.glob("*.list"))
                                                  if place.is_dir() else [place] if place.exists() else [])]
    for path in files:
        for line in path.read_text().splitlines():
            words = line.split()
            uris = words[1:] if words[:1] == ["URIs:"] else words[1:2] if words[:1] == ["deb"] else []
            for uri in uris:
                if uri.startswith("http") and not uri.rstrip("/").endswith("-security"):
                    return uri.rstrip("/")
    raise RuntimeError(f"no Debian archive found in apt's sources ({', '.join(map(str, APT_SOURCES))}): set "
                       "DEW_DEBIAN_MIRROR to the archive's URL (the folder that holds dists/ and pool/)")
STATE = Path(os.environ.get("DEW_ENGINE_HOME", Path.home() / ".cache" / "dew-ray" / "engines")).parent
PID_FILE = STATE / "dockerd.pid"
LOG_FILE = STATE / "dockerd.log"


class ContainerEngineError(RuntimeError):
    """A step of providing the container engine failed; the message names the step and what to do."""


def _run(argv: list[str], step: str, timeout: float = 1800, **kwargs) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ContainerEngineError(f"{step}: {' '.join(argv[:4])} failed ({error})") from None
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip()[-2000:]
        raise ContainerEngineError(f"{step}: {' '.join(argv[:4])} exited {result.returncode}: {tail}")
    return result


def answers() -> bool:
    """Whether a Docker daemon answers ``docker info``."""
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def has_image(tag: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", tag], capture_output=True, timeout=60).returncode == 0


def install() -> bool:
    """Step 1: Debian's docker.io and debootstrap, when ``dockerd`` or ``debootstrap`` is missing; False when neither
    is."""
    missing = [p for p, binary in (("docker.io", "dockerd"), ("debootstrap", "debootstrap"))
               if shutil.which(binary) is None and not os.path.exists(f"/usr/sbin/{binary}")]
    if not missing:
        return False
    apt_install(missing, "the container engine", "or install Docker your own way")
    return True


def apt_install(packages: list[str], what: str, otherwise: str) -> None:
    """Debian's ``packages`` through apt-get as root, for ``what``; ``otherwise`` says what else a user can do."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ContainerEngineError(
            f"installing {what}: {', '.join(packages)} missing, and apt-get as root is needed to install "
            f"them (run `apt-get install -y {' '.join(packages)}` as root, {otherwise})")
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _run(["apt-get", "update", "-qq"], f"installing {what} (apt-get update)", env=environment)
    _run(["apt-get", "install", "-y", "-qq", *packages], f"installing {what} (apt-get install)", env=environment)


def start_daemon(wait: float = 60.0) -> int | None:
    """Step 2: start ``dockerd`` when none answers; returns its pid, or None when one was already answering."""
    if answers():
        return None
    dockerd = shutil.which("dockerd") or "/usr/sbin/dockerd"
    if not os.path.exists(dockerd):
        raise ContainerEngineError("starting the Docker daemon: dockerd is not installed (step 1, `up`, installs it)")
    if os.geteuid() != 0:
        raise ContainerEngineError("starting the Docker daemon: no daemon answers `docker info` and starting dockerd "
                                   "needs root (start it as root, or use rootless Docker and set DOCKER_HOST)")
    STATE.mkdir(parents=True, exist_ok=True)
    with open(LOG_FILE, "ab") as log:
        daemon = subprocess.Popen([dockerd], stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    PID_FILE.write_text(str(daemon.pid))
    end = time.monotonic() + wait
    while time.monotonic() < end:
        if daemon.poll() is not None:
            raise ContainerEngineError(f"starting the Docker daemon: dockerd exited {daemon.returncode}; its log: "
                                       f"{LOG_FILE.read_text()[-2000:]}")
        if answers():
            return daemon.pid
        time.sleep(0.3)
    raise ContainerEngineError(f"starting the Docker daemon: no answer to `docker info` after {wait:.0f} s (log: "
                               f"{LOG_FILE})")


def stop_daemon() -> bool:
    """Stop the daemon ``start_daemon`` started (its pid file says which); False when it started none."""
    if not PID_FILE.exists():
        return False
    pid = int(PID_FILE.read_text())
    PID_FILE.unlink()
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    return True


def build_base(tag: str = BASE_IMAGE) -> bool:
    """Step 3: the base image (Debian bookworm minbase with python3) by debootstrap; False when already there."""
    if has_image(tag):
        return False
    debootstrap = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
    with tempfile.TemporaryDirectory(prefix="dew-rootfs-") as rootfs:
        _run([debootstrap, "--variant=minbase", "--include=python3", "bookworm", rootfs, debian_mirror()],
             "building the base image (debootstrap)")
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        _run(["docker", "import", "-", tag], "building the base image (docker import)", stdin=tar.stdout)
        tar.wait()
    return True


def extra_ca_certificates() -> str:
    """The certificates this machine trusts beyond Debian's (``/usr/local/share/ca-certificates``), as PEM text:
    where a TLS-inspecting proxy stands between the build and PyPI, the image must trust what the host does."""
    folder = Path("/usr/local/share/ca-certificates")
    files = sorted(folder.rglob("*.crt")) if folder.is_dir() else []
    return "".join(path.read_text().strip() + "\n" for path in files)


def build_project(tag: str = PROJECT_IMAGE) -> str:
    """Step 4: the project's image from the Dockerfile; returns the build's last lines.

    Docker's classic builder (``DOCKER_BUILDKIT=0``): Debian's docker.io brings no buildx plugin."""
    argv = ["docker", "build", "--tag", tag]
    if certificates := extra_ca_certificates():
        argv += ["--build-arg", f"EXTRA_CA_CERTS={certificates}"]
    result = _run([*argv, str(ROOT)], "building the project's image (docker build)",
                  env={**os.environ, "DOCKER_BUILDKIT": "0"})
    return "\n".join(result.stdout.strip().splitlines()[-2:])


def install_plugins() -> list[str]:
    """Step 5: the ``docker compose`` v2 and ``docker buildx`` plugins, each when ``docker <name> version`` fails;
    returns the names installed."""
    installed = []
    for name, package in PLUGINS.items():
        if subprocess.run(["docker", name, "version"], capture_output=True, timeout=60).returncode == 0:
            continue
        step = f"installing docker {name}"
        if os.geteuid() != 0:
            raise ContainerEngineError(f"{step}: writing {PLUGIN_DIR / ('docker-' + name)} needs root")
        with tempfile.TemporaryDirectory(prefix="dew-plugin-") as folder:
            deb = Path(folder) / "plugin.deb"
            _run(["curl", "-fsSL", "-o", str(deb), f"{debian_mirror()}/{package}"], f"{step} (downloading {package})")
            _run(["dpkg-deb", "-x", str(deb), str(Path(folder) / "files")], f"{step} (unpacking {deb.name})")
            PLUGIN_DIR.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(folder) / "files" / "usr/libexec/docker/cli-plugins" / f"docker-{name}",
                         PLUGIN_DIR / f"docker-{name}")
        _run(["docker", name, "version"], f"{step} (checking the plugin)")
        installed.append(name)
    return installed


def ensure(project: bool = False, harbor: bool = False) -> int | None:
    """Every step; returns the pid of a daemon it started (stop it with ``stop_daemon``), else None."""
    install()
    started = start_daemon()
    build_base()
    if project:
        build_project()
    if harbor:
        install_plugins()
    return started


def missing_step(project: bool = False, harbor: bool = False) -> str | None:
    """The first step not done, in words, or None when the engine and images are ready."""
    if shutil.which("docker") is None:
        return "the docker CLI is not installed (`uv run python tools/container_env.py up` installs it)"
    if not answers():
        return "no Docker daemon answers `docker info` (`uv run python tools/container_env.py up` starts one)"
    for tag, wanted in ((BASE_IMAGE, True), (PROJECT_IMAGE, project)):
        if wanted and not has_image(tag):
            return f"the image {tag} is not built (`uv run python tools/container_env.py up --project` builds it)"
    for name in PLUGINS if harbor else ():
        if subprocess.run(["docker", name, "version"], capture_output=True, timeout=60).returncode:
            return f"docker {name} is not installed (`uv run python tools/container_env.py up --harbor` installs it)"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "down", "check"])
    parser.add_argument("--project", action="store_true", help="also build the project's image (the Dockerfile)")
    parser.add_argument("--harbor", action="store_true",
                        help="also install docker compose v2 and buildx (Harbor's Docker environment drives them)")
    args = parser.parse_args(argv)
    if args.action == "down":
        print("stopped the Docker daemon `up` started" if stop_daemon() else "no daemon started by `up` to stop")
        return 0
    if args.action == "check":
        step = missing_step(args.project, args.harbor)
        print(step or "the container engine and images are ready")
        return 1 if step else 0
    try:
        began = time.monotonic()
        installed = install()
        print(f"container engine {'installed' if installed else 'already installed'} "
              f"({time.monotonic() - began:.0f} s)", flush=True)
        began = time.monotonic()
        pid = start_daemon()
        print(f"Docker daemon {'started, pid %d' % pid if pid else 'already answering'} "
              f"({time.monotonic() - began:.1f} s)", flush=True)
        began = time.monotonic()
        built = build_base()
        print(f"base image {BASE_IMAGE} {'built' if built else 'cached'} ({time.monotonic() - began:.0f} s)", flush=True)
        if args.project:
            began = time.monotonic()
            tail = build_project()
            print(f"project image {PROJECT_IMAGE} built ({time.monotonic() - began:.0f} s): {tail}", flush=True)
        if args.harbor:
            began = time.monotonic()
            installed = install_plugins()
            print(f"docker compose and buildx plugins: {', '.join(installed) or 'none'} installed "
                  f"({time.monotonic() - began:.0f} s)", flush=True)
    except ContainerEngineError as error:
        print(f"container engine: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
