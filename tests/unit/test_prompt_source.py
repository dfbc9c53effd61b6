"""The prompt source hands out the token ids a row's rendered prompt has, whether it tokenized the
row alone or with the rest of a step's prompts in one call."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from relax_core.data.cursor import DatasetCursor
from relax_core.data.prompts import PromptSource

TEXTS = [
    "What is 7 plus 5?",
    "Add twelve and thirty.",
    "  leading spaces and\ttabs",
    "unicode: naïve café – 3+4",
    "What is 7 plus 5?",  # a duplicate row
    "x",
]


def _bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<unk>", "<eos>"])
    tok.train_from_iterator(TEXTS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return fast


@pytest.mark.parametrize("template, system", [("plain", ""), ("chat", "Be brief.")])
def test_a_step_of_prompts_has_each_row_s_own_token_ids(template, system):
    tok = _bpe()
    rows = [{"prompt": t, "answer": "0"} for t in TEXTS]
    batched = PromptSource(rows, tok, template, system, seed=3, shuffle=True)
    items, _ = batched.take(DatasetCursor(epoch=0, index=0), len(rows))
    alone = PromptSource(rows, tok, template, system, seed=3, shuffle=True)
    assert sorted(item.prompt_index for item in items) == list(range(len(rows)))
    for item in items:
        assert item.prompt_ids == alone.prompt_ids(item.prompt_index), item.row["prompt"]
        assert item.prompt_ids  # rendered prompts are never empty here
