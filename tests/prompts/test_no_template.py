"""A tokenizer without a chat template (Gemma 3 270M, a pretrained model): the plain layout, after
the BOS token where the tokenizer puts one before plain text."""

from __future__ import annotations

from ragcache_backend.prompts.builder import PromptBuilder, bos_text


class _Tokenizer:
    """Characters as ids; ``<bos>`` (id 2) parsed as a control token unless split."""

    chat_template = None
    bos_token, bos_token_id = "<bos>", 2

    def __init__(self, adds_bos: bool) -> None:
        self.adds_bos = adds_bos

    def __call__(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> dict:
        ids = [2] if text == "<bos>" and not split_special_tokens else [ord(c) for c in text]
        return {"input_ids": ([2] if add_special_tokens and self.adds_bos else []) + ids}


def test_the_plain_layout_starts_with_bos_when_the_tokenizer_adds_one():
    with_bos, without = _Tokenizer(adds_bos=True), _Tokenizer(adds_bos=False)
    assert bos_text(with_bos) == "<bos>" and bos_text(without) == ""
    segs = PromptBuilder(with_bos, system_prompt="S").build("q?", [("doc", None)])
    assert segs[0].token_ids == (2, ord("S"), ord("\n"), ord("\n"))
    assert PromptBuilder(without, system_prompt="S").build("q?", [("doc", None)])[0].token_ids == (ord("S"), 10, 10)
    # a document's own "<bos>" text stays plain text
    assert 2 not in PromptBuilder(with_bos).document("<bos> x").token_ids
