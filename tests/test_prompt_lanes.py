"""One huge text prompt holds no other prompt: it is refused after counting only part of its tokens, and a
long text is templated and tokenized in its own lane (its own thread and tokenizer copy), so a short prompt
is served while it runs. The piecewise count is a lower bound of the whole text's tokens (or a refusal could
be wrong): checked on random texts and on this repository's own source, with the tiny tokenizer and the
default model's."""

import asyncio
import threading
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import server.prompts as prompts_module
from minivllm.engine.validation import RequestError
from minivllm.models.loader import load_tokenizer
from server.prompts import LONG_TEXT_CHARS, PromptBuilder
from tests.server_thread import ServerThread, assert_error, tiny_settings

MODEL = "tiny"
REPO = Path(__file__).resolve().parents[1]
HUGE = ("The quick brown fox jumps over the lazy dog. " * 90_000)[: 4 << 20]  # one line, 4 MiB
ALPHABET = "ab yz\n\t  .,;:!?-_(){}01239éü\u0301中文😀'\"<|>"


@pytest.fixture(scope="module")
def builder(tiny_model_dir):
    return PromptBuilder(load_tokenizer(Path(tiny_model_dir)), 2048)


def _source_texts() -> list[str]:
    return [p.read_text() for p in sorted((REPO / "server").glob("*.py"))[:8]]


def _assert_counts_at_most(builder: PromptBuilder, text: str) -> None:
    exact = len(builder.tokenizer.encode(text, add_special_tokens=False))
    assert builder.tokens_at_least(text, room=1 << 30) <= exact


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.sampled_from(ALPHABET), max_size=400))
def test_the_piecewise_count_never_overcounts(builder, text):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prompts_module, "COUNTED_PIECE", 3)  # many cuts, at every kind of place
        _assert_counts_at_most(builder, text)


@pytest.mark.parametrize("piece", [16, 256])
def test_the_piecewise_count_never_overcounts_source_code(builder, piece, monkeypatch):
    monkeypatch.setattr(prompts_module, "COUNTED_PIECE", piece)
    for text in _source_texts():
        _assert_counts_at_most(builder, text)


@pytest.mark.slow
def test_the_piecewise_count_never_overcounts_on_the_default_tokenizer(monkeypatch):
    from minivllm.models.default_model import default_model_dir

    qwen = PromptBuilder(load_tokenizer(default_model_dir()), 32768)
    monkeypatch.setattr(prompts_module, "COUNTED_PIECE", 64)
    for text in [*_source_texts(), (REPO / "README.md").read_text(), HUGE[:100_000]]:
        _assert_counts_at_most(qwen, text)


def test_a_huge_text_is_refused_after_counting_only_part_of_it(tiny_model_dir, monkeypatch):
    """A context whose length bound (13 characters per token, the tiny vocabulary's longest) lets 4 MiB
    through, while 8 characters per token would not: counted in pieces, refused about halfway (4.5
    characters per token, about 932,000 tokens)."""
    builder = PromptBuilder(load_tokenizer(Path(tiny_model_dir)), 400_000)
    assert len(HUGE) <= 400_000 * builder.max_token_chars and len(HUGE) > 400_000 * 8
    encoded: list[int] = []
    encode = builder.tokenizer.encode

    def counted(text, *args, **kw):
        encoded.append(len(text))
        return encode(text, *args, **kw)

    monkeypatch.setattr(builder.tokenizer, "encode", counted)
    for refuse in (
        lambda: builder._completion_ids([HUGE], 16),
        lambda: builder._chat_ids([{"role": "user", "content": HUGE}], 16),
    ):
        encoded.clear()
        with pytest.raises(RequestError) as e:
            refuse()
        assert e.value.code == "context_length_exceeded" and "at least" in e.value.message
        assert 0 < sum(encoded) < len(HUGE) * 0.6  # the pieces up to the context, not the 4 MiB


# -- the lanes --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(tiny_settings(tiny_model_dir)) as s:
        yield s


def test_a_short_prompt_is_served_while_a_long_one_is_tokenized(server, monkeypatch):
    """The long lane's worker is held until the short request has its answer: with one lane for both, the
    short request would wait behind it and time out."""
    prompts = server.app.state.server.prompts
    assert prompts.long is not prompts and prompts.long.tokenizer.hf is not prompts.tokenizer.hf
    entered, release = threading.Event(), threading.Event()
    tokenize = prompts.long._completion_ids

    def held(*args):
        entered.set()
        release.wait(60)
        return tokenize(*args)

    monkeypatch.setattr(prompts.long, "_completion_ids", held)
    long_text = "word " * (LONG_TEXT_CHARS // 5 + 100)

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            body = {"model": MODEL, "prompt": long_text, "max_tokens": 1}
            long_request = asyncio.create_task(http.post("/v1/completions", json=body))
            while not entered.is_set():  # the long prompt is on its worker, held there
                assert not long_request.done(), long_request
                await asyncio.sleep(0.01)
            try:
                short = await http.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
                )
                assert not long_request.done()  # still held: the short one did not wait for it
            finally:
                release.set()
            return short, await long_request

    short, long_answer = asyncio.run(scenario())
    assert short.status_code == 200 and short.json()["choices"][0]["text"] is not None
    assert_error(long_answer, 400)  # longer than the tiny model's context, refused once counted
    server.wait_idle()


def test_without_lanes_there_is_one_tokenizer(tiny_model_dir):
    tokenizer = load_tokenizer(Path(tiny_model_dir))
    single = PromptBuilder(tokenizer, 2048, long_lane=False)
    assert single.long is single
    laned = PromptBuilder(tokenizer, 2048, long_lane=True)
    assert laned.long.tokenizer.backend is not tokenizer.backend and laned.long.max_model_len == 2048
    laned.close()
    single.close()
