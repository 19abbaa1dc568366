# wkvm on CPU: `docker build -t wkvm .` then
#   docker run -p 8000:8000 -e WKVM_API_KEY=secret wkvm                 (serves the embedded model)
#   docker run -p 8000:8000 -e WKVM_API_KEY=secret -v /models:/models wkvm --model /models/rwkv7.pth
# Without an API key the server binds 127.0.0.1 inside the container, so nothing outside can reach it.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    WKVM_STATE_DIR=/data/states

# a C++ compiler: wkvm builds its int8, int4 and fused kernels for the CPU it runs on, on first use (cached under
# ~/.cache/wkvm); without one they dequantize per call and decode is several times slower
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# torch's CPU wheel (the default index's Linux wheel pulls ~5 GB of CUDA libraries)
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

WORKDIR /src
COPY pyproject.toml README.md ./
COPY wkvm ./wkvm
RUN pip install . && rm -rf /src
COPY docker/entrypoint.sh /usr/local/bin/wkvm-entrypoint

RUN useradd --create-home --uid 10001 wkvm && mkdir -p /data/states && chown -R wkvm /data
USER 10001
WORKDIR /home/wkvm
VOLUME ["/data"]
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('WKVM_PORT', '8000'), timeout=4)"]

ENTRYPOINT ["wkvm-entrypoint"]
