# reshard: trainer_svc, inference_svc and the operator commands in one image.
#
#   docker build -t reshard .                       # CPU (gloo data plane)
#   docker run --rm reshard demo --model small      # the local 2 -> 4 demo inside one container
#   docker compose up                               # certs (once), inference + trainer + one update (docker-compose.yml)
#
# Build arguments
#   TORCH_SPEC      the torch requirement installed before the project (default torch==2.13.0).
#   PIP_EXTRA_ARGS  extra pip arguments used for that torch install ONLY, e.g. to point pip at a
#                   wheel index of your choice:
#                     --build-arg PIP_EXTRA_ARGS="--index-url <your CPU wheel index URL>"
#                   A plain index serves the large CUDA-enabled torch on Linux x86_64; a CPU wheel
#                   index keeps the image small. For GPUs point it at a CUDA wheel index matching
#                   the host driver. The rest of the install uses pip's normal configuration.
#   WITH_NCCL       1 installs the `nccl` extra (nvidia-nccl-cu12) for GPU data planes; use it with a
#                   CUDA torch:
#                     docker build --build-arg WITH_NCCL=1 \
#                       --build-arg PIP_EXTRA_ARGS="--index-url <your CUDA wheel index URL>" -t reshard:gpu .
#                   GPU containers also need the NVIDIA container toolkit on the host and a GPU
#                   reservation at run time (see docker-compose.yml).
FROM python:3.11-slim

ARG TORCH_SPEC=torch==2.13.0
ARG PIP_EXTRA_ARGS=""
ARG WITH_NCCL=0

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RESHARD_LOG_LEVEL=INFO

# torch first, on its own layer: it is by far the largest dependency, and installing it before the
# project keeps `pip install .` from resolving `torch>=2.4` to whatever build the default index has.
RUN pip install ${PIP_EXTRA_ARGS} "${TORCH_SPEC}"

# Only what the package build needs (pyproject.toml maps these directories to reshard.*), so a local
# .venv or build output in the checkout never ends up in the image.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli ./cli
COPY common ./common
COPY tools ./tools
COPY trainer_svc ./trainer_svc
COPY inference_svc ./inference_svc
COPY integrations ./integrations
COPY proto ./proto

# The tls extra (cryptography) is what `reshard certs` needs: docker-compose.yml issues its certificates
# and tokens with this image.
RUN if [ "${WITH_NCCL}" = "1" ]; then pip install ".[nccl,tls]"; else pip install ".[tls]"; fi \
    && python -c "import reshard.cli, torch, cryptography; print('reshard installed, torch', torch.__version__)" \
    && cd / && rm -rf /src

# Run as an unprivileged user. The services spawn their workers as child processes of the same user.
# /certs is where docker-compose.yml mounts its `certs` volume: docker gives a new, empty named volume
# the owner and mode of the image's folder, so this one lets `reshard certs` (as this user) write it
# and keeps it closed to others.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin reshard \
    && install -d -o reshard -g reshard -m 0700 /certs
USER reshard
WORKDIR /home/reshard

# Default service ports (the compose file's choice; any --listen works).
EXPOSE 50051 50052

ENTRYPOINT ["reshard"]
CMD ["--help"]
