"""Our LangChain and LlamaIndex classes with ``base_url=`` against a real ``vllm serve`` running
RAGCacheConnector (vLLM's CPU build from ``benchmarks/.venv-vllm``, the default model's weights):
answers stream and count tokens exactly (vLLM's ``return_token_ids``), repeated prompts report
vLLM's cached tokens, our retrievers' speculative pipelining runs as streamed vLLM requests (a
terminated one is aborted in vLLM by closing its stream), and what vLLM cannot do is refused clearly.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import httpx
import pytest
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough

from ragcache_backend.errors import InvalidRequestError
from ragcache_integrations._speculation import speculation_board
from ragcache_integrations.langchain import ChatRAGCache, RAGCacheLLM, RAGCacheRetriever
from ragcache_integrations.llamaindex import RAGCacheLLM as LlamaLLM
from tests.integrations.rag_prompts import RLM_RAG_PROMPT, format_docs
from tests.integrations.vllm.test_vllm_connector import MODEL, PROMPT, ROOT, VLLM_PY, _require_vllm

pytestmark = [pytest.mark.model, pytest.mark.slow]
SERVED = "smollm2"
CONNECTOR = ('{"kv_connector": "RAGCacheConnector", "kv_connector_module_path": "ragcache_integrations.vllm", '
             '"kv_role": "kv_both"}')


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory):
    """``vllm serve`` with RAGCacheConnector on loopback; yields its base URL (``.../v1``)."""
    _require_vllm()
    tmp = tmp_path_factory.mktemp("vllm-serve")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAGCACHE_", "VLLM_"))}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), RAGCACHE_HOME=str(tmp / "home"),
               VLLM_CPU_OMP_THREADS_BIND="nobind", NO_PROXY="127.0.0.1,localhost")
    cmd = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
           "--model", str(MODEL), "--served-model-name", SERVED, "--dtype", "float32", "--max-model-len", "2048",
           "--enable-prefix-caching", "--enable-prompt-tokens-details", "--kv-cache-memory-bytes", str(256 << 20),
           "--seed", "0", "--enforce-eager",  # no torch.compile: ~75 s less per start on 2 cores
           "--kv-transfer-config", CONNECTOR]
    log = tmp / "vllm.log"
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        yield f"{base}/v1"
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(30)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue


def running(vllm_url: str, timeout: float = 20.0) -> float:
    """vLLM's ``num_requests_running`` once it drops to 0 (or after ``timeout``)."""
    base = vllm_url.removesuffix("/v1")
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{base}/metrics").text
        value = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("vllm:num_requests_running"))
        if value == 0 or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_chat_and_completion_through_vllm(vllm_url):
    llm = ChatRAGCache(base_url=vllm_url, max_tokens=12)
    assert llm.reported_model_name() == SERVED
    first, again = llm.invoke(PROMPT), llm.invoke(PROMPT)
    assert first.content == again.content and first.content
    assert first.usage_metadata["output_tokens"] == again.usage_metadata["output_tokens"] <= 12
    cached = again.usage_metadata["input_token_details"]["cache_read"]
    assert cached >= 0.8 * again.usage_metadata["input_tokens"]  # vLLM's prefix cache, reported through us
    assert "".join(c.content for c in llm.stream(PROMPT)) == first.content
    text = RAGCacheLLM(base_url=vllm_url, max_tokens=8, chat_template=False).invoke("def fibonacci(n):")
    li = LlamaLLM(base_url=vllm_url, max_tokens=8, chat_template=False)
    assert li.complete("def fibonacci(n):").text == text
    assert li.metadata.context_window == 2048


def test_speculative_pipelining_through_vllm(faq_store, faq_questions, vllm_url):
    llm = ChatRAGCache(base_url=vllm_url, max_tokens=8)
    prompt = ChatPromptTemplate.from_messages([("human", RLM_RAG_PROMPT)])

    def chain(retriever):
        return {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm

    questions = faq_questions[60:63]
    expected = [(chain(RAGCacheRetriever(store=faq_store, k=3, speculate=False)) | StrOutputParser()).invoke(q)
                for q in questions]
    board = speculation_board()
    board.forget()
    taken = board.taken
    piped = chain(RAGCacheRetriever(store=faq_store, k=3))
    got = [piped.invoke(q) for q in questions]
    assert [m.content for m in got] == expected
    assert board.taken - taken == len(questions) - 1
    assert all(m.response_metadata["speculation_kept"] for m in got[1:])
    assert running(vllm_url) == 0  # terminated speculative requests were aborted in vLLM


def test_closing_a_stream_aborts_the_vllm_request(vllm_url):
    stream = ChatRAGCache(base_url=vllm_url, max_tokens=1000).stream("Write a long story about a lighthouse.")
    next(stream), next(stream)
    stream.close()
    assert running(vllm_url) == 0


def test_what_vllm_cannot_do_is_refused_clearly(vllm_url):
    with pytest.raises(InvalidRequestError, match="ragcache serve"):
        ChatRAGCache(base_url=vllm_url, reuse="auto").invoke("hi")
    with pytest.raises(InvalidRequestError, match="refused"):  # vLLM's own 400, typed
        ChatRAGCache(base_url=vllm_url, max_tokens=100_000).invoke("hi")

