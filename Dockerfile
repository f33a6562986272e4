# One image for both compose services: the CPU-only API and the GPU worker.
# Kaolin wheels exist per torch/CUDA pair, so the base image pins both; change the three
# ARGs together (see NVIDIA's Kaolin installation page for the published pairs).
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.1-cudnn9-runtime
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.5.1
ARG CUDA_TAG=cu121
ARG KAOLIN_VERSION=0.18.0

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# Kaolin first, against the torch the base image already has (never upgrade torch here).
RUN pip install "kaolin==${KAOLIN_VERSION}" \
      -f "https://nvidia-kaolin.s3.us-east-2.amazonaws.com/torch-${TORCH_VERSION}_${CUDA_TAG}.html"

COPY pyproject.toml README.md ./
COPY spcache ./spcache
COPY cache_store ./cache_store
COPY workers ./workers
COPY service ./service
RUN pip install "torch==${TORCH_VERSION}" . && spcache --help >/dev/null

RUN useradd --create-home --uid 1000 spcache && mkdir -p /cache && chown spcache /cache
USER spcache
VOLUME ["/cache"]
EXPOSE 8000
ENTRYPOINT ["spcache"]
