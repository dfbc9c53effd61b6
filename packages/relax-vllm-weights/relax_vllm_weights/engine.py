"""The worker side of `relax_gloo` (see the package doc): imported by vLLM's factory in its workers."""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.logger import init_logger

from relax_vllm_weights import GlooInitInfo, GlooUpdateInfo, gloo_group

logger = init_logger(__name__)


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()  # a second init (a new trainer) replaces the group
        rank = init_info.rank_offset + self.parallel_config.rank
        self.group = gloo_group(init_info, rank)
        logger.info(
            "relax_gloo: joined weight group %s as rank %d of %d",
            init_info.group_name,
            rank,
            init_info.world_size,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        retie_output_head(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class then synchronizes an accelerator; gloo on CPU tensors has none.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError(
                "relax_gloo: no weight group; POST /init_weight_transfer_engine first"
            )
        if not (len(update_info.names) == len(update_info.dtype_names) == len(update_info.shapes)):
            raise ValueError("relax_gloo: names, dtype_names and shapes differ in length")
        specs = []
        for name, dtype_name, shape in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, strict=True
        ):
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"relax_gloo: {name}: unknown dtype {dtype_name!r}")
            specs.append((name, dtype, [int(d) for d in shape]))
        nbytes = [
            torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            for _, dtype, shape in specs
        ]
        flat = torch.empty(sum(nbytes), dtype=torch.uint8)
        self.group.broadcast(flat, 0).wait()
        named, offset = [], 0
        for (name, dtype, shape), size in zip(specs, nbytes, strict=True):
            named.append((name, flat[offset : offset + size].view(dtype).view(shape)))
            offset += size
        self.model.load_weights(named)

    def shutdown(self) -> None:
        self.group = None


def retie_output_head(model: torch.nn.Module, model_config: Any) -> None:
    """A tied output head reads the embedding again, and its kernel is built again from it.

    The head receives no weights of its own (a tied checkpoint has none), so the layerwise
    reload neither reloads nor reprocesses it: on CPU its GEMM keeps the packed copy of the old
    embedding it made at load time (vLLM's dispatch_cpu_unquantized_gemm), and its parameter may
    still be the embedding's old one."""
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    if not getattr(hf, "tie_word_embeddings", False):
        return
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or head is embed:
        return
    head.weight = embed.weight
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
