"""Harbor's own Docker environment, with the two images it takes from Docker Hub made locally.

Harbor 0.25's ``DockerEnvironment`` (``harbor/environments/docker/docker.py``) runs each trial with
``docker compose``; for a task whose agent phase asks for ``network_mode = "allowlist"`` it first
probes the kernel for nftables support in an ``alpine`` container pinned by digest, then builds an
egress-control sidecar FROM ``gogost/gost`` and runs the task's container in the sidecar's network
namespace. Neither image can be had where no registry is reachable, so this subclass changes those
two and nothing else:

* the kernel probe (Harbor's own script: ``CONFIG_NFT_FIB_INET`` in ``/proc/config.gz``) runs in
  ``dew-ray/base:bookworm``, the base image ``tools/container_env.py`` makes with debootstrap;
* the sidecar is built from ``dew_harbor/egress_sidecar``, a stand-in written from Harbor's
  sidecar (the same entrypoint contract, ``network-policy`` commands, nftables table and ready
  file) that enforces the allowlist with nftables on the addresses the allowed hosts resolve to
  when the policy is applied, instead of gost's SNI and Host sniffing; wildcard hostnames are
  refused. Harbor builds it, content-addressed, as it builds its own.

Use it as ``harbor trials start ... --env dew_harbor.docker:DockerEnvironment`` (``HarborCLI(args=
["--env", "dew_harbor.docker:DockerEnvironment"])``), with this repository on ``PYTHONPATH``.
Compose v2 and the base image come from ``uv run python tools/container_env.py up --harbor``.
"""

from __future__ import annotations

from pathlib import Path

from harbor.environments.docker.docker import DockerEnvironment as HarborDockerEnvironment

BASE_IMAGE = "dew-ray/base:bookworm"


class DockerEnvironment(HarborDockerEnvironment):
    """Harbor's DockerEnvironment with the kernel probe's and the sidecar's images made locally (see the module)."""

    _EGRESS_CONTROL_KERNEL_PROBE_IMAGE = BASE_IMAGE
    _EGRESS_CONTROL_SIDECAR_CONTEXT_PATH = Path(__file__).resolve().parent / "egress_sidecar"
    _EGRESS_CONTROL_SIDECAR_DOCKER_NAME = "dew-ray/harbor:egress-sidecar"
