# One image for every torchyard process (api, scheduler, worker, db upgrade): the command
# picks which. Installs from the repository's own files with the pinned constraints.

# The dashboard's static files (web/ built by esbuild, its packages pinned by the lock file).
FROM node:20-slim AS web
WORKDIR /app/web
COPY web/package.json web/package-lock.json ./
RUN npm ci --no-audit --no-fund
COPY web/ ./
RUN node build.mjs

FROM python:3.11-slim

# bubblewrap: the sandbox every trainer runs in (worker/sandbox.py).
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap \
 && rm -rf /var/lib/apt/lists/*

ENV PYTHONDONTWRITEBYTECODE=1 \
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
