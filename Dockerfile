# The image of compose.yaml's `sluice` and `upstream` services: Sluice and
# the demo upstream are one Python package.
FROM python:3.11-slim

# What the package is built from, and nothing else (see .dockerignore).
COPY pyproject.toml README.md /src/
COPY sidecar /src/sidecar
RUN pip install --no-cache-dir /src && rm -rf /src

USER nobody
EXPOSE 8181
# compose.yaml gives each service its own command; by itself the image runs
# Sluice with its embedded default rules.
CMD ["sluice", "serve", "--host", "0.0.0.0", "--port", "8181"]
