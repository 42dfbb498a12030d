# Tokens-only engine for NVIDIA GPUs, non-root. Build from the repository root:
#   docker build -f deploy/docker/engine.Dockerfile -t splitserve-engine .
# The base image brings CUDA 12.x, cuDNN and a matching torch; NIXL's CUDA 13 build is installed without its
# meta package's extra dependencies, and xgrammar without a second triton (see Makefile).
FROM pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
WORKDIR /src
COPY pyproject.toml README.md ./
COPY splitserve_common splitserve_common
COPY render_service render_service
COPY token_engine token_engine
COPY bench bench
RUN pip install --no-cache-dir '.[engine]' \
 && pip install --no-cache-dir --no-deps nixl==1.5.1 nixl-cu12==1.5.1 xgrammar==0.2.9 \
 && useradd --uid 10001 --create-home splitserve
USER 10001
ENV PYTHONUNBUFFERED=1 UCX_LOG_LEVEL=error NIXL_LOG_LEVEL=WARN
EXPOSE 8000 5600
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status == 200 else 1)"
ENTRYPOINT ["token-engine", "serve"]
