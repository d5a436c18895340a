"""Prompts: segment builder (chat template), document recognition inside prompts, detokenizer."""
