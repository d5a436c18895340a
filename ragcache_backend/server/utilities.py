"""The server's token and embedding routes: vLLM's ``/tokenize`` and ``/detokenize`` (the served
model's tokenizer, prompts as generation would see them) and OpenAI's ``/v1/embeddings`` (the
retrieval embedder that ``ragcache index`` uses, so a client can search with the same vectors)."""

from __future__ import annotations

import asyncio
import base64
import threading

import numpy as np

from ragcache_backend.errors import InvalidRequestError
from ragcache_backend.retrieval.embedder import Embedder
from ragcache_backend.server.errors import APIError
from ragcache_backend.server.prompting import chat_turns
from ragcache_backend.server.schema import (
    DetokenizeRequest,
    DetokenizeResponse,
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    TokenizeRequest,
    TokenizeResponse,
)
from ragcache_backend.server.service import CompletionService

__all__ = ["TokenRoutes"]

#: The most texts one embeddings request may hold (OpenAI's limit).
MAX_EMBEDDING_INPUTS = 2048


class TokenRoutes:
    """What the three routes do, over ``service`` (its engine's tokenizer and prompt assembly).

    The embedder loads on the first embeddings request (a few seconds), not at start."""

    def __init__(self, service: CompletionService, embedder: Embedder | None = None) -> None:
        self.service = service
        self._embedder = embedder
        self._lock = threading.Lock()

    def embedder(self) -> Embedder:
        with self._lock:
            if self._embedder is None:
                self._embedder = Embedder()
            return self._embedder

    def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """Raises APIError 400: neither or both of ``prompt`` and ``messages``, options off their defaults."""
        self.service.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if body.add_generation_prompt is False or body.add_special_tokens is True:
            raise APIError(400, "add_generation_prompt=false and add_special_tokens=true are not supported",
                           param="add_generation_prompt" if body.add_generation_prompt is False else "add_special_tokens",
                           code="unsupported_parameter")
        reuse = self.service.settings.reuse
        try:
            prompt = (self.service.prompts.chat(chat_turns(body.messages), reuse) if body.messages is not None
                      else self.service.prompts.raw(body.prompt, reuse))
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param="messages" if body.messages is not None else "prompt") from None
        tokens = [t for s in prompt.segments for t in s.token_ids]
        return TokenizeResponse(count=len(tokens), max_model_len=self.service.engine.loaded.context_window,
                                tokens=tokens)

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """Raises APIError 400: a token id outside the vocabulary."""
        self.service.check_model(body.model)
        vocab = self.service.engine.runner.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary of {vocab} tokens", param="tokens",
                           code="invalid_value")
        return DetokenizeResponse(prompt=self.service.engine.loaded.tokenizer.decode(body.tokens))

    async def embeddings(self, body: EmbeddingRequest) -> EmbeddingResponse:
        """Raises APIError 400: empty texts, too many, ``dimensions`` (the embedder's are fixed);
        404: a ``model`` other than the embedder's name."""
        embedder = self.embedder()
        if body.model and body.model != embedder.name:
            raise APIError(404, f"the embedding model {body.model!r} does not exist; this server embeds with "
                                f"{embedder.name!r}", param="model", code="model_not_found")
        texts = [body.input] if isinstance(body.input, str) else list(body.input)
        if not texts or len(texts) > MAX_EMBEDDING_INPUTS or any(not t for t in texts):
            raise APIError(400, f"input must be 1 to {MAX_EMBEDDING_INPUTS} non-empty texts", param="input",
                           code="invalid_value")
        if body.dimensions is not None:
            raise APIError(400, "dimensions is not supported: the embedder's vectors have a fixed size",
                           param="dimensions", code="unsupported_parameter")
        vectors, used = await asyncio.to_thread(lambda: (embedder.embed(texts), embedder.count_tokens(texts)))
        data = [Embedding(index=i, embedding=base64.b64encode(v.astype("<f4").tobytes()).decode()
                          if body.encoding_format == "base64" else np.asarray(v, dtype=np.float32).tolist())
                for i, v in enumerate(vectors)]
        return EmbeddingResponse(data=data, model=embedder.name, usage=EmbeddingUsage(prompt_tokens=used,
                                                                                      total_tokens=used))
