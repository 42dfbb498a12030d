# Render tier and gateway: CPU only, slim, non-root. Build from the repository root:
#   docker build -f deploy/docker/render.Dockerfile -t splitserve-render .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY splitserve_common splitserve_common
COPY render_service render_service
COPY token_engine token_engine
COPY bench bench
# The render tier needs no torch: install the base dependencies only.
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim
COPY --from=build /install /usr/local
RUN useradd --uid 10001 --create-home splitserve
USER 10001
ENV PYTHONUNBUFFERED=1 SPLITSERVE_CACHE=/home/splitserve/.cache/splitserve
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status == 200 else 1)"
ENTRYPOINT ["render-service", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
