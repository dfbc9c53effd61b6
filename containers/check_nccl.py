"""Fails an image build whose Python would join a weight group with another NCCL build than the
one containers/nccl.txt pins: `python check_nccl.py nccl.txt`, run by every environment's
Python after its packages are installed."""

from __future__ import annotations

import importlib.metadata
import sys


def pinned(path: str) -> tuple[str, str]:
    """(distribution, version) of the one `name==version` line of `path`."""
    with open(path) as f:
        lines = [x.strip() for x in f if x.strip() and not x.lstrip().startswith("#")]
    if len(lines) != 1 or "==" not in lines[0]:
        sys.exit(f"{path}: expected one 'nvidia-nccl-cu*==X.Y.Z' line, got {lines}")
    name, version = lines[0].split("==")
    return name.strip(), version.strip()


def main() -> None:
    name, version = pinned(sys.argv[1])
    try:
        got = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"{sys.executable}: {name} is not installed ({version} pinned in {sys.argv[1]})")
    if got != version:
        sys.exit(f"{sys.executable}: {name} {got} installed, {version} pinned ({sys.argv[1]})")
    import torch

    loaded = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    if loaded is not None and ".".join(map(str, loaded)) != version:
        sys.exit(f"{sys.executable}: torch loads NCCL {loaded}, {version} pinned")
    print(f"{sys.executable}: torch {torch.__version__}, {name} {got}")


if __name__ == "__main__":
    main()
