"""Torch rollout engine: batched sampling from an HF causal LM with a KV cache, in process.

Prompts are left-padded into one batch; positions count real tokens only, so a prompt's log-probs do
not depend on what it was batched with. A prompt repeated in the batch (a group's samples) is
prefilled once and its KV cache indexed out to its rows. Rows that emit EOS stop contributing
tokens; once they are a quarter of the decode batch they leave it and the KV cache. Tokens are
sampled where the logits are, from one uniform per row of the engine's own CPU generator. On a
CPU, text generation of a Llama-family decoder runs through rollout/decoder.py's lean forward
(the same modules without transformers' per-call mask and cache work; the same tokens and
log-probs to float32 rounding).

Media (an omni policy, models/omni.py): `generate(..., media=)` gives each prompt its encoded
media inputs; they go with every prefill (the first step, and a rebuild after new weights) and
never with decode steps, whose new tokens are text. A policy with multimodal rotary positions
(multimodal/protocol.MultimodalDecoder) gives the prefill's positions [3, B, T]; a decode step's
are the last ones + 1, as for text.

Routing replay (models/routing_replay.py attached to an MoE policy): each forward records the
experts its tokens were routed to, and a completion carries them for prompt + response but the
last token (which no forward took as input), as SGLang reports them.

Partial rollouts: with `weight_poll` set, the engine calls it between decode steps; when it
reports that new weights were loaded, the KV cache (computed by the old weights) is rebuilt by
one prefill of prompt + tokens so far, and generation continues under the new weights. Each
token's log-prob stays the one of the weights that sampled it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from contextlib import nullcontext

import torch
from transformers import DynamicCache, PreTrainedModel

from relax_core.models.precision import bucket_length
from relax_core.models.routing_replay import routing_of
from relax_core.multimodal.protocol import MultimodalDecoder
from relax_core.rollout.decoder import lean_decoder
from relax_core.rollout.engine import Completion, SamplingParams
from relax_core.rollout.sampling import sample_tokens


def _last_logits_only(model: torch.nn.Module) -> dict[str, int]:
    """{"logits_to_keep": 1} when the model's forward (a PEFT model's: its base model's) names
    transformers' `logits_to_keep`, else {}."""
    import inspect

    base = getattr(model, "get_base_model", None)
    forward = (base() if callable(base) else model).forward
    return (
        {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(forward).parameters else {}
    )


class TorchEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        eos_token_id: int,
        pad_token_id: int,
        seed: int = 0,
        max_batch_size: int = 1024,
    ) -> None:
        self.model = model.eval()
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.version = 0
        self._paused = False
        self.weight_poll: Callable[[], bool] | None = None
        """Called between decode steps; returns True when it loaded new weights."""
        self.lean = lean_decoder(self.model)
        """The text generation forward on a CPU (rollout/decoder.py), or None where the model is
        not one it computes: transformers' forward then."""
        self._last_only = _last_logits_only(model)
        """Forward keyword that computes the LM head at the last position only (a prefill of
        64 prompts of 256 tokens with a 152k vocabulary would otherwise make 5 GB of logits
        to keep 1/256 of them); empty where the model's forward does not take it."""

    # ------------------------------------------------------------------ generation
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, media: list | None = None
    ) -> list[Completion]:
        if self._paused:
            raise RuntimeError("engine is paused for a weight update; resume() before generate()")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if media is not None and len(media) != len(prompts):
            raise ValueError(f"media for {len(media)} prompts, {len(prompts)} prompts given")
        out: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch_size):
            end = start + self.max_batch_size
            chunk = None if media is None else media[start:end]
            out.extend(self._generate_batch(prompts[start:end], params, chunk))
        return out

    @torch.inference_mode()
    def _generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, media: list | None = None
    ) -> list[Completion]:
        batch, width = len(prompts), max(len(p) for p in prompts)
        # Left-padded, each built by one tensor call (a call per row costs more than its values).
        pad = self.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        positions = self._positions(input_ids, mask, media)
        cache = DynamicCache()
        tokens = torch.full((batch, params.max_new_tokens), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((batch, params.max_new_tokens))
        done = torch.zeros(batch, dtype=torch.bool)
        lengths = torch.full((batch,), params.max_new_tokens, dtype=torch.long)
        step_ids, step_pos = input_ids, positions
        first_version = self.version
        last_version = torch.full((batch,), first_version, dtype=torch.long)
        prefill = True
        device = next(self.model.parameters()).device
        routing = routing_of(self.model)
        routes = None  # [B, columns, L, K]: the experts of each column of prompt + response
        if routing is not None:
            shape = (batch, width + params.max_new_tokens, routing.num_layers, routing.top_k)
            routes = torch.zeros(shape, dtype=torch.int32)
        # Rows still generating, as indices into the batch: finished rows leave the decode batch
        # (and the KV cache) once they are a quarter of it, so a few long answers do not drag
        # every finished row through the remaining steps. Not with media, routing capture or
        # mid-generation weight loads, whose prefill is rebuilt for every row.
        rows = torch.arange(batch)
        compact = media is None and routing is None and self.weight_poll is None
        lean = self.lean if compact and device.type == "cpu" else None
        first = None
        if lean is not None:
            first = self._lean_prefill(lean, prompts, input_ids, mask, positions, params)
        elif compact:
            first = self._shared_prefill(prompts, input_ids, mask, positions, cache, device)
        for t in range(params.max_new_tokens):
            extra = {"media": media} if prefill and media is not None else {}
            with routing.capture() if routing is not None else nullcontext() as captured:
                if t == 0 and first is not None:
                    logits = first
                elif lean is not None:
                    logits = lean.forward(step_ids, torch.ones_like(step_ids), step_pos)
                else:
                    logits = self.model(
                        input_ids=step_ids.to(device),
                        attention_mask=mask.to(device),
                        position_ids=step_pos.to(device),
                        past_key_values=cache,
                        use_cache=True,
                        **extra,
                        **self._last_only,
                    ).logits[:, -1]
            if captured is not None:  # this forward's tokens are the last columns of `mask`
                routes[:, mask.shape[1] - step_ids.shape[1] : mask.shape[1]] = captured.tokens(
                    batch
                )
            prefill = False
            # Sampled where the logits are, from uniforms of the engine's own CPU generator
            # (its state is checkpointed); only the tokens and their log-probs come back.
            # Slots past len(rows) are padding (see the compaction below): never sampled, so the
            # generator's draws are those of the live rows alone.
            tok, lp = sample_tokens(
                logits[: len(rows)], params.temperature, params.top_p, params.greedy, self.generator
            )
            tok, lp = tok.cpu(), lp.cpu()
            live = ~done[rows]
            last_version[rows[live]] = self.version
            tok = tok.masked_fill(~live, self.pad_token_id)
            tokens[rows, t], logprobs[rows, t] = tok, lp
            newly_done = rows[live & (tok == self.eos_token_id)]
            lengths[newly_done] = t + 1
            done[newly_done] = True
            if bool(done.all()):
                break
            slots = mask.shape[0]  # decode slots: the live rows, then any padding
            step_ids = torch.cat([tok, tok[-1:].expand(slots - len(rows))]).unsqueeze(-1)
            step_pos = step_pos[..., -1:] + 1
            mask = torch.cat([mask, torch.ones((slots, 1), dtype=torch.long)], dim=-1)
            finished = done[rows]
            if compact and int(finished.sum()) * 4 >= len(rows):
                keep = (~finished).nonzero().squeeze(1)
                live_rows = rows[keep]
                # On a CPU the decode batch keeps a size of 8 an octave (models/precision.py),
                # the last live row repeated: a new size is a new oneDNN kernel for every
                # linear layer (the tiny task's generation 45.7 -> 43.2 ms median).
                if device.type == "cpu":
                    repeat = keep[-1:].expand(bucket_length(len(keep)) - len(keep))
                    keep = torch.cat([keep, repeat])
                if lean is not None:
                    lean.select(keep)
                else:
                    cache.batch_select_indices(keep.to(device))
                rows, step_ids, step_pos, mask = (
                    live_rows,
                    step_ids[keep],
                    step_pos[keep],
                    mask[keep],
                )
            if self.weight_poll is not None and self.weight_poll():
                # The cache holds keys/values of the old weights: one prefill rebuilds it.
                step_ids = torch.cat([input_ids, tokens[:, : t + 1]], dim=-1)
                step_pos = self._positions(step_ids, mask, media)
                cache = DynamicCache()
                prefill = True
        out = self._completions(tokens, logprobs, lengths, done, first_version, last_version)
        if routes is not None:
            out = _with_routes(out, routes, [len(p) for p in prompts], width)
        return out

    def _lean_prefill(self, lean, prompts, input_ids, mask, positions, params) -> torch.Tensor:
        """The first step's logits [B, V] from the lean decoder's prefill, of each distinct
        prompt once (a group's samples repeat theirs), its cache rows then indexed out to every
        row that repeats it."""
        row, firsts = _distinct(prompts)
        lean.start(len(firsts), input_ids.shape[1] + params.max_new_tokens)
        first = torch.tensor(firsts)
        logits = lean.forward(input_ids[first], mask[first], positions[first])
        rows = torch.tensor(row)
        lean.select(rows)
        return logits[rows]

    def _shared_prefill(self, prompts, input_ids, mask, positions, cache, device):
        """A group's samples repeat their prompt: prefill each distinct prompt once and index
        its KV cache out to every row (text prompts only, as for row compaction). Returns the
        first step's logits [B, V], or None (no prompt repeats) to prefill as usual."""
        row, firsts = _distinct(prompts)
        if len(firsts) == len(row):
            return None
        first = torch.tensor(firsts)
        logits = self.model(
            input_ids=input_ids[first].to(device),
            attention_mask=mask[first].to(device),
            position_ids=positions[first].to(device),
            past_key_values=cache,
            use_cache=True,
            **self._last_only,
        ).logits[:, -1]
        rows = torch.tensor(row)
        cache.batch_select_indices(rows.to(device))
        return logits[rows.to(logits.device)]

    def _positions(self, ids: torch.Tensor, mask: torch.Tensor, media: list | None) -> torch.Tensor:
        """Prefill positions: real tokens counted from 0 (left pads get 0), or the policy's
        multimodal positions [3, B, T] when it places media in position space."""
        if media is not None and isinstance(self.model, MultimodalDecoder):
            return self.model.position_ids(ids, mask, media)
        return (mask.cumsum(-1) - 1).clamp(min=0)

    def _completions(
        self,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        lengths: torch.Tensor,
        done: torch.Tensor,
        first_version: int,
        last_version: torch.Tensor,
    ) -> list[Completion]:
        # Whole tensors to lists once: a tensor op per row costs more than the row's values.
        ids, lps, finished = tokens.tolist(), logprobs.tolist(), done.tolist()
        versions = last_version.tolist()
        return [
            Completion(
                response_ids=ids[row][:n],
                logprobs=lps[row][:n],
                finish_reason="stop" if finished[row] else "length",
                policy_version=first_version,
                policy_version_max=None if versions[row] == first_version else versions[row],
            )
            for row, n in enumerate(lengths.tolist())
        ]

    # ------------------------------------------------------------------ weights and control
    @torch.no_grad()
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"engine model has no parameter {name!r}")
            params[name].copy_(tensor)
        self.version = version

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    def health(self) -> dict[str, object]:
        return {"ok": True, "policy_version": self.version, "paused": self._paused}


def _distinct(prompts: list[list[int]]) -> tuple[list[int], list[int]]:
    """(each prompt's index among the distinct prompts, each distinct prompt's first row)."""
    index: dict[tuple[int, ...], int] = {}
    row, firsts = [], []
    for i, p in enumerate(prompts):
        row.append(index.setdefault(tuple(p), len(index)))
        if len(index) > len(firsts):
            firsts.append(i)
    return row, firsts


def _with_routes(
    completions: list[Completion], routes: torch.Tensor, prompt_lens: list[int], width: int
) -> list[Completion]:
    """Each completion with the experts of its prompt + response tokens but the last, one list
    of num_layers * top_k ints per token (`routes` [B, columns, L, K], prompts left-padded to
    `width`)."""
    flat = routes.flatten(2)
    return [
        dataclasses.replace(
            c, routed_experts=flat[row, width - p : width + len(c.response_ids) - 1].tolist()
        )
        for row, (c, p) in enumerate(zip(completions, prompt_lens, strict=True))
    ]
