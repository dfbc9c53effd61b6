"""The GPUs a plan is made for: total memory by card, under the names `services.accelerator`
uses and the short ones `relax plan --gpu` takes."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class Gpu:
    name: str
    """What the printed plan calls the card."""
    memory: int
    """Bytes the card has (what torch.cuda.get_device_properties reports as total_memory)."""

    @property
    def gib(self) -> float:
        return self.memory / GIB


# Total memory as the CUDA driver reports it (a card sold as "80 GB" shows 79.2 GiB).
CARDS: dict[str, Gpu] = {
    "nvidia-h100": Gpu("NVIDIA H100 80GB", int(79.2 * GIB)),
    "nvidia-h200": Gpu("NVIDIA H200", int(139.8 * GIB)),
    "nvidia-a100-80gb": Gpu("NVIDIA A100 80GB", int(79.2 * GIB)),
    "nvidia-tesla-a100": Gpu("NVIDIA A100 40GB", int(39.4 * GIB)),
    "nvidia-rtx-pro-6000": Gpu("NVIDIA RTX PRO 6000", int(94.9 * GIB)),
    "nvidia-l40s": Gpu("NVIDIA L40S", int(44.4 * GIB)),
    "nvidia-a10g": Gpu("NVIDIA A10G", int(22.0 * GIB)),
    "nvidia-l4": Gpu("NVIDIA L4", int(22.0 * GIB)),
    "nvidia-l4-vws": Gpu("NVIDIA L4", int(22.0 * GIB)),
    "nvidia-tesla-v100": Gpu("NVIDIA V100 16GB", int(15.8 * GIB)),
    "nvidia-tesla-t4": Gpu("NVIDIA T4", int(14.6 * GIB)),
    "nvidia-tesla-p100": Gpu("NVIDIA P100", int(15.9 * GIB)),
    "nvidia-tesla-k80": Gpu("NVIDIA K80", int(11.2 * GIB)),
    "nvidia-tesla-p4": Gpu("NVIDIA P4", int(7.4 * GIB)),
    "nvidia-tesla-m60": Gpu("NVIDIA M60", int(7.4 * GIB)),
}

DEFAULT_CARD = "nvidia-h100"
"""The card a GPU config is planned for when it names none (the lent machines' card)."""


def gpu_named(name: str) -> Gpu:
    """The card `name` names: an accelerator name (`nvidia-h200`) or its short form (`h200`)."""
    key = name.strip().lower()
    for candidate in (key, f"nvidia-{key}", f"nvidia-tesla-{key}"):
        if candidate in CARDS:
            return CARDS[candidate]
    short = sorted({k.removeprefix("nvidia-").removeprefix("tesla-") for k in CARDS})
    raise ValueError(f"unknown GPU {name!r}; one of: {', '.join(short)}")


def card_of(accelerator: str, memory_gib: float = 0.0) -> Gpu:
    """The card a `services.accelerator` name means: a Flyte name (`nvidia-h100`), another
    cloud's node label value naming the same card (GKE's `nvidia-h100-80gb`,
    `nvidia-h100-mega-80gb`), or, with `memory_gib`, any card of that much memory."""
    if memory_gib:
        return Gpu(accelerator, int(memory_gib * GIB))
    if accelerator in CARDS:
        return CARDS[accelerator]
    name = accelerator.lower()
    # Longest first: 'a100-80gb' before 'a100', 'l4-vws' before 'l4'.
    tokens = sorted(
        ((k.removeprefix("nvidia-").removeprefix("tesla-"), k) for k in CARDS),
        key=lambda t: -len(t[0]),
    )
    for token, key in tokens:
        if f"-{token}-" in f"-{name.removeprefix('nvidia-')}-".replace("-tesla-", "-"):
            return CARDS[key]
    raise ValueError(
        f"services.accelerator: {accelerator!r} names no card the memory plan knows; set "
        "services.gpu_memory_gib to one GPU's memory (or plan with relax plan --gpu)"
    )
