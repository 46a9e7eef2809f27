# vllm-router (the PyPI package: a Rust router with a Python launcher) for deploy/kubernetes/vllm-router/.
#   docker build -f deploy/vllm-router.Dockerfile -t REGISTRY/vllm-router:0.1.17 deploy
# The wheel is manylinux_2_28 (glibc >= 2.28): python:3.11-slim (Debian 12, glibc 2.36) runs it.
FROM python:3.11-slim
RUN pip install --no-cache-dir vllm-router==0.1.17 \
 && useradd --uid 10001 --no-create-home router
USER 10001
EXPOSE 8080 29000
ENTRYPOINT ["vllm-router"]
