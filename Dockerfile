# One image for every torchyard process (api, scheduler, worker, db upgrade): the command
# picks which. Installs from the repository's own files with the pinned constraints.
# Both base images are build arguments (defaults: the official images), so a host without
# an image registry can build from local ones (deploy/images/, scripts/deploy_test.sh):
#   --build-arg PYTHON_IMAGE=localhost/torchyard-base:bookworm --build-arg NODE_IMAGE=<that base + nodejs>
# A bare Debian base will do for PYTHON_IMAGE (python3 then comes from its packages);
# deploy/images/node.Containerfile adds Debian's nodejs to one for NODE_IMAGE.
ARG NODE_IMAGE=node:20-slim
ARG PYTHON_IMAGE=python:3.11-slim

# The dashboard's static files (web/ built by esbuild, its packages pinned by the lock file).
FROM ${NODE_IMAGE} AS web
WORKDIR /app/web
COPY web/package.json web/package-lock.json ./
RUN npm ci --no-audit --no-fund
COPY web/ ./
RUN node build.mjs

FROM ${PYTHON_IMAGE}

# bubblewrap: the sandbox every trainer runs in (worker/sandbox.py). A base without Python
# (plain Debian) gets Debian's python3 (3.11 on bookworm). Either way torchyard lives in
# its own venv, /opt/venv, first on PATH: `python` and `torchyard` are the venv's.
RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap \
    $(command -v python3 >/dev/null || echo python3 python3-venv) \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first, in their own layer: editing the code does not reinstall torch.
COPY pyproject.toml constraints.txt ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
 && pip install -c constraints.txt -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

COPY . .
COPY --from=web /app/api/static ./api/static
RUN pip install -c constraints.txt . \
 && useradd --create-home --uid 1000 torchyard \
 && mkdir -p /srv/torchyard/home /srv/torchyard/storage /srv/torchyard/data \
 && chown -R torchyard:torchyard /srv/torchyard

USER torchyard
ENV TORCHYARD_HOME=/srv/torchyard/home \
    TORCHYARD_STORAGE_ROOT=/srv/torchyard/storage \
    TORCHYARD_DATA_ROOT=/srv/torchyard/data
EXPOSE 8000

ENTRYPOINT ["torchyard"]
CMD ["api", "--host", "0.0.0.0", "--port", "8000"]
