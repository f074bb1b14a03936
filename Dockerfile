# Sluice's image; also the demo upstream of compose.yaml and of the
# Kubernetes example (a file beside the package, see below).
#
#   docker build -t sluice-ratelimit:0.2.0 .
#
# Three stages: the base (Python, Sluice's user and its dependencies), the
# builder (a C compiler over the base: it builds Sluice's wheel with its
# compiled core) and the image, the base with that wheel installed, which
# ships no compiler. The dependencies are installed from requirements.lock,
# pinned with their hashes, in a layer of their own: a change to Sluice's
# code rebuilds only the last layers. Regenerate the lock after changing
# pyproject.toml's dependencies (see its header, and docs/architecture.md,
# "The lock file"); requirements-build.lock, the build's Cython and
# setuptools, after changing its build-system requires (see its header).
FROM python:3.11-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# A numeric user: Kubernetes' runAsNonRoot accepts only a numeric USER.
RUN groupadd --system --gid 10001 sluice \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin sluice

# Wheels only, each checked against its hash: nothing is compiled here.
COPY requirements.lock /tmp/requirements.lock
RUN pip install --require-hashes --only-binary=:all: -r /tmp/requirements.lock \
 && rm /tmp/requirements.lock


# Sluice's wheel, with its compiled core (Cython's C of the package's typed
# modules, see setup.py), built by Debian's gcc with the pinned Cython and
# setuptools. What it is built from, and nothing else (see .dockerignore):
# the nginx and Envoy templates are the top-level nginx/ and envoy/ folders,
# which sidecar/templates links to (COPY keeps the links; the build follows them).
FROM base AS builder
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY requirements-build.lock /tmp/requirements-build.lock
RUN pip install --require-hashes --only-binary=:all: -r /tmp/requirements-build.lock
COPY pyproject.toml setup.py README.md LICENSE /src/
COPY nginx /src/nginx
COPY envoy /src/envoy
COPY sidecar /src/sidecar
RUN pip wheel --no-deps --no-build-isolation --wheel-dir /wheels /src


FROM base
# Sluice itself, without dependencies (all installed above), from the
# builder's wheel, mounted for this step only: no compiler, no wheel and
# no source in the image.
RUN --mount=type=bind,from=builder,source=/wheels,target=/tmp/wheels \
    pip install --no-deps /tmp/wheels/*.whl \
 && python -c "import sidecar.core as core; print(core.which()); raise SystemExit(core.PURE)"
# The demo application of compose.yaml and of deploy/kubernetes (`python
# /opt/sluice/demo_upstream.py --port 9000`): a development tool of the
# repository (devstack/), which the package and its wheel do not carry;
# here a file beside them, which Sluice never imports.
COPY devstack/demo_upstream.py /opt/sluice/demo_upstream.py

USER 10001:10001
# The check port (HTTP: checks, /healthz, /readyz, /metrics, the admin API),
# nginx's response reports (syslog over UDP), and the gRPC port when asked
# for (--grpc-port 8183: ext_authz, and the Rate Limit Service with
# --rls-config).
ENV SLUICE_HOST=0.0.0.0 SLUICE_PORT=8181
EXPOSE 8181 8182/udp 8183
# Liveness of the check port; slim images have no curl. A compose service
# that runs another command from this image sets its own healthcheck.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('SLUICE_PORT', '8181') + '/healthz', timeout=2)"]
# Sluice needs its rules: mount a rules file and give --config FILE (or
# SLUICE_CONFIG); without them it exits at once, saying so. --demo-rules
# runs the demo rules of `make run`, to try the image.
CMD ["sluice", "serve", "--hook-udp", "0.0.0.0:8182"]
