# The dew-ray image: Python 3.11 (Debian bookworm), uv, the project with its locked dependencies, bubblewrap.
#
#   uv run python tools/container_env.py up --project     # base image, then this one, as dew-ray/dew-ray:latest
#   docker build -t dew-ray/dew-ray:latest .              # the same build by hand, once the base image exists
#   docker build --build-arg ENGINES=vllm-cuda -t dew-ray/dew-ray:vllm-cuda .   # with vLLM for NVIDIA GPUs
#
# The base, dew-ray/base:bookworm, is made locally by tools/container_env.py (debootstrap + docker import), so
# the build needs no registry; any Debian or Ubuntu image with python3 (>= 3.11) can replace it: --build-arg BASE=...
# The KubeRay manifests (cluster_configs/rayjob*.yaml) and cluster_configs/ray-cluster.yaml run this image: push it to
# a registry your nodes reach (docker tag dew-ray/dew-ray:latest REGISTRY/dew-ray:latest; docker push ...) and put
# that name in them. The project lives at /app, its environment at /app/.venv (first on PATH).
# bubblewrap inside a container needs to create namespaces and mount a fresh /proc: run the container with
# --security-opt seccomp=unconfined --security-opt systempaths=unconfined (the manifests say how on Kubernetes),
# or choose runner = "process" for trusted code.
ARG BASE=dew-ray/base:bookworm
FROM ${BASE}

# python3-venv for uv's own venv; bubblewrap and util-linux for the sandbox; ca-certificates for PyPI and model hubs;
# g++ builds dew's bfloat16 weight-product kernel on first use (dew/models/native_product.py; without it XLA's dot serves).
# EXTRA_CA_CERTS: PEM certificates to trust besides Debian's, for builds behind a TLS-inspecting proxy
# (tools/container_env.py passes the host's /usr/local/share/ca-certificates).
ARG EXTRA_CA_CERTS=""
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3-venv bubblewrap util-linux procps ca-certificates g++ \
 && rm -rf /var/lib/apt/lists/* \
 && if [ -n "$EXTRA_CA_CERTS" ]; then printf '%s\n' "$EXTRA_CA_CERTS" > /usr/local/share/ca-certificates/extra.crt \
      && update-ca-certificates >/dev/null; fi
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt PIP_CERT=/etc/ssl/certs/ca-certificates.crt

ARG UV_VERSION=0.13.9
RUN python3 -m venv /opt/uv && /opt/uv/bin/pip install --no-cache-dir --disable-pip-version-check "uv==${UV_VERSION}" \
 && ln -s /opt/uv/bin/uv /usr/local/bin/uv

WORKDIR /app
ENV UV_PYTHON_DOWNLOADS=never UV_LINK_MODE=copy UV_COMPILE_BYTECODE=1 UV_NO_CACHE=1 \
    DEW_ENGINE_HOME=/opt/dew-engines PATH=/app/.venv/bin:$PATH

# The locked dependencies first, so a change to the project's code reuses this layer; none of the default groups
# (dev: the tests' tools; docs: the documentation site's generator).
COPY pyproject.toml uv.lock README.md ./
RUN uv sync --frozen --no-default-groups --no-install-project

COPY dew ./dew
COPY dew_ray ./dew_ray
COPY dew_harbor ./dew_harbor
COPY tools ./tools
COPY cluster_configs ./cluster_configs
COPY examples ./examples
# Only the project is installed here; the dependencies were compiled to bytecode in their own layer above.
RUN UV_COMPILE_BYTECODE=0 uv sync --frozen --no-default-groups

# Optional inference engines (space-separated names from tools/engine_env.py: "vllm" for CPUs, "vllm-cuda" for
# NVIDIA GPUs, "harbor", "gateway"), each in its own environment under DEW_ENGINE_HOME.
ARG ENGINES=""
RUN for engine in ${ENGINES}; do uv run --no-sync python tools/engine_env.py "$engine" || exit 1; done

CMD ["dew-ray", "--help"]
