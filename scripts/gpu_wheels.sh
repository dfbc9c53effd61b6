#!/usr/bin/env bash
# Fetch, on a machine with a package registry, the wheels that scripts/gpu_check.sh installs on a
# GPU machine that has CUDA torch and transformers but nothing else of ours (Python 3.12):
#
#   scripts/gpu_wheels.sh            # into .whl/ (git-ignored), ~21 MB
#
# megatron-core for the Megatron backend, and MLflow's client (mlflow-skinny: the tracking
# client, the SQLite store and the model registry, without the UI's 30 MB) with what it imports,
# so whole runs (`python -m relax_core.entrypoints.run`) and the gpu-marked whole-run tests run
# there. Packages such an image already has (numpy, pyarrow, pandas, requests, click, jinja2,
# cloudpickle, anyio, ...) are not fetched: two versions of one package stop the install.
# PYTHON_VERSION (default 3.12) picks the target interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PYTHON_VERSION=${PYTHON_VERSION:-3.12}

python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version "$PYTHON_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  megatron-core==0.19.2 \
  mlflow-skinny==3.17.2 mlflow-tracing==3.17.2 \
  SQLAlchemy==2.1.9 alembic==1.20.1 Mako==1.4.3 \
  cryptography==48.0.0 cffi==2.0.0 pycparser==3.0 \
  databricks-sdk==0.162.0 google-auth==2.63.0 pyasn1==0.6.3 pyasn1_modules==0.4.2 rsa==4.7.2 \
  cachetools==7.3.3 protobuf==7.36.2 \
  opentelemetry-api==1.45.2 opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2 \
  opentelemetry-semantic-conventions==0.66b2 \
  pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
  typing_extensions==4.16.0 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 python-multipart==0.0.34 \
  sqlparse==0.6.1 importlib_metadata==9.1.0 GitPython==3.2.1 gitdb==4.0.12 smmap==5.0.3 \
  python-dotenv==1.2.2
du -sh .whl
