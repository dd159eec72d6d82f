# The image of megascale-data's coordinator, worker hosts and relays (deploy/helm/msd runs it).
#   make image        (docker build -t megascale-data/msd:VERSION .)
# It installs with tools/install.sh, the script `make install` and so CI's fresh install run: what
# CI tests is what this image installs. No torch (only trainer processes need it; they run the
# training image), no compilers in the final stage, a non-root user, nothing written outside
# /tmp and the mounted volumes (the chart runs it with a read-only root file system).
FROM python:3.11-slim AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN tools/install.sh /opt/msd \
    && /opt/msd/bin/python -m compileall -q /opt/msd/lib

FROM python:3.11-slim
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin msd
COPY --from=build /opt/msd /opt/msd
ENV PATH=/opt/msd/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MSD_CACHE_DIR=/var/cache/msd
USER 10001:10001
EXPOSE 5555 5600 9090 9091
CMD ["msd", "--help"]
