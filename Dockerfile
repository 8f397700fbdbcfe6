# syntax=docker/dockerfile:1
#
# Kazma in a container: a slim image, a non-root user, bubblewrap for the shell sandbox,
# kazma.yaml and the store on volumes, a health check on /healthz.
#
#   docker build -t kazma .
#   docker run --rm kazma demo --terminal                 # the scripted demo: no tokens, no model
#   docker run -d --name kazma -p 127.0.0.1:8765:8765 \
#       -v "$PWD/kazma.yaml:/etc/kazma/kazma.yaml:ro" -v kazma-state:/var/lib/kazma \
#       --env-file kazma.env kazma                        # `kazma run` behind your TLS reverse proxy
#
# In the container the console must listen on 0.0.0.0 (web.host) to be reachable through the
# published port, with web.public_url the proxy's https:// address (README: Running in production).

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY config/ config/
COPY approvals/ approvals/
COPY adapters/ adapters/
COPY engine/ engine/
COPY bot/ bot/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
# bubblewrap: the sandbox `shell` runs in (tools.sandbox). Nothing else from Debian is needed.
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --system --user-group --uid 10001 --home-dir /var/lib/kazma --create-home --shell /usr/sbin/nologin kazma \
    && chmod 0700 /var/lib/kazma \
    && install -d -o kazma -g kazma -m 0755 /etc/kazma
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-cache-dir /tmp/wheels/*.whl && rm -rf /tmp/wheels

# The store (.kazma/: approvals, the console's tokens), the workspaces and the decision key
# (.kazma-keys/, or KAZMA_DECISION_KEY) live on the state volume; kazma.yaml on the config volume (or a
# read-only bind mount). Relative paths in kazma.yaml start at KAZMA_BASE_DIR, not at the file's folder.
ENV KAZMA_CONFIG=/etc/kazma/kazma.yaml \
    KAZMA_BASE_DIR=/var/lib/kazma \
    KAZMA_HEALTHZ=http://127.0.0.1:8765/healthz \
    PYTHONUNBUFFERED=1
WORKDIR /var/lib/kazma
USER kazma
VOLUME ["/etc/kazma", "/var/lib/kazma"]
EXPOSE 8765
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; sys.exit(urllib.request.urlopen(os.environ['KAZMA_HEALTHZ'], timeout=4).status != 200)"]
ENTRYPOINT ["kazma"]
CMD ["run"]
