# A GPU image (`--target gpu`, the last stage, so the default) and a CPU image (`--target cpu`). The model is mounted, not baked in:
#   docker run --gpus all -v /models/Qwen2.5-7B-Instruct:/model:ro -e MODEL_PATH=/model \
#     -e KAFKA_BOOTSTRAP_SERVERS=kafka:9092 -e DYNAMIC_BATCHING=true \
#     -e HTTP_TOKEN="$(openssl rand -hex 32)" -p 127.0.0.1:3000:3000 deepanalyze
# The image listens on 0.0.0.0 (STATUS_HOST), as a published port needs, so HTTP_TOKEN is required:
# without it the worker refuses to start. Every route but /healthz (the HEALTHCHECK below) then asks
# for `Authorization: Bearer <token>`, or a login in the browser.
FROM scratch AS source
COPY pyproject.toml README.md /app/
COPY schemas /app/schemas
COPY prompts /app/prompts
COPY engine /app/engine
COPY pipeline /app/pipeline

FROM python:3.11-slim-bookworm AS cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    STATUS_HOST=0.0.0.0 MODEL_PATH=/model
# gcc: on a CPU the engine builds its small C kernels at start, for the CPU it runs on: decode
# attention in place (engine/attention_native.c; gcc's -fopenmp links the libgomp torch ships) and,
# with KV_COMPRESSION, quantised KV reads (engine/kv_native.c); without a compiler torch does both, slower.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 analyst
WORKDIR /app
COPY --from=source /app ./
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install . \
 && pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
USER analyst
EXPOSE 3000
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:3000/healthz').status != 200)"
ENTRYPOINT ["deepanalyze"]
CMD ["run"]

FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS gpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    STATUS_HOST=0.0.0.0 MODEL_PATH=/model DEVICE=cuda
RUN apt-get update && apt-get install -y --no-install-recommends software-properties-common \
 && add-apt-repository -y ppa:deadsnakes/ppa && apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -m venv /opt/venv && useradd --create-home --uid 10001 analyst
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY --from=source /app ./
RUN pip install --index-url https://download.pytorch.org/whl/cu128 torch==2.13.0 \
 && pip install '.[grammar]'
USER analyst
EXPOSE 3000
HEALTHCHECK --interval=15s --timeout=3s --start-period=180s \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:3000/healthz').status != 200)"
ENTRYPOINT ["deepanalyze"]
CMD ["run"]
