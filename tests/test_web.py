"""The built-in web page, in a real headless Chromium (Debian's package, driven by playwright; .ci/run
installs both, nothing is downloaded at test time): chat through the <textarea> + Enter, cached tokens on
the second turn, the stop button aborts, the cache panel shows /v1/cache/stats, no console errors."""

import os
import shutil
from pathlib import Path

import httpx
import pytest

from minivllm.models import backend
from server.settings import Settings
from tests.server_thread import ServerThread
from tests.test_server import tiny_settings
from tests.tiny_model import make_tiny_model

playwright = pytest.importorskip("playwright.sync_api", reason="needs the dev extra: pip install playwright")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium package")
SCREENSHOTS = Path(__file__).resolve().parent.parent / "docs" / "images"
FLAGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(tiny_settings(tiny_model_dir, cache_shadow_interval=0.2)) as s:
        yield s


@pytest.fixture()
def page(server):
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(
            viewport={"width": 1200, "height": 760}, bypass_csp=True
        )  # the test evaluates scripts
        errors: list[str] = []
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.url + "/")
        yield page
        assert errors == []
        browser.close()


def running(server) -> int:
    return server.engine.stats().running


def ask(page, text: str) -> None:
    page.locator("textarea").fill(text)
    page.locator("textarea").press("Enter")


def test_a_conversation_streams_and_its_second_turn_is_cached(server, page):
    ask(page, "Tell me about paged attention and prefix caches in a few words, please. " * 4)
    stats = page.locator(".stats").nth(0)
    stats.filter(has_text="cached").wait_for(timeout=120_000)  # the usage chunk closed the stream
    assert page.locator(".msg.assistant").nth(0).inner_text().strip()
    # why the prompt missed (the stream's x-minivllm-prefix-cache comment): this prompt was never seen
    assert "cache stopped at message 0, token 0: new content" in stats.inner_text()
    assert page.locator("#warning").is_hidden()  # this machine has OpenBLAS: nothing to fix
    ask(page, "And once more, please.")
    second = page.locator(".stats").nth(1)
    second.filter(has_text="cached").wait_for(timeout=120_000)
    assert int(second.get_attribute("data-cached")) > 0  # the first turn's prefix was restored
    if os.environ.get("MINIVLLM_UPDATE_SCREENSHOTS"):  # the README's picture, from this very test
        SCREENSHOTS.mkdir(exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "web-page.png"))


ANSWER_TOKENS = 1500


def long_answer_prompt(server) -> str:
    """A prompt whose greedy answer on the tiny model runs to ANSWER_TOKENS (no EOS before): the stop
    button then always has a running answer to stop."""
    client = server.client()
    for i in range(20):
        text = f"Write a very long story, number {i}."
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": text}],
            max_tokens=ANSWER_TOKENS,
            temperature=0,
        )
        if r.choices[0].finish_reason == "length":
            return text
    raise AssertionError("no prompt with a long greedy answer")


def test_the_stop_button_aborts_the_request_on_the_server(server, page):
    text = long_answer_prompt(server)
    page.locator("#max-tokens").fill(str(ANSWER_TOKENS))
    page.locator("#temperature").fill("0")
    ask(page, text)
    page.wait_for_function("document.querySelector('.msg.assistant').textContent.length > 0", timeout=60_000)
    page.locator("#stop").click()
    page.locator(".stats", has_text="stopped").wait_for(timeout=30_000)
    server.wait_idle(timeout=30)  # the disconnect aborted it: nothing runs, no page is held
    assert running(server) == 0


def test_the_cache_panel_shows_the_servers_numbers(server, page):
    ask(page, "Hello there, cache panel.")
    page.locator(".stats").nth(0).filter(has_text="cached").wait_for(timeout=120_000)
    server.wait_idle()
    truth = httpx.get(server.url + "/v1/cache/stats").json()
    shown = {
        "prompt tokens looked up": "prefix_query_tokens",
        "pages free": "pages_free",
        "pages cached": "pages_cached",
    }
    page.wait_for_function(  # the panel polls every 1.5 s: wait until it has caught up with the idle server
        "want => Object.entries(want).every(([k, v]) => document.querySelector(`dd[data-key='${k}']`)?.textContent == String(v))",
        arg={label: truth[key] for label, key in shown.items()},
        timeout=10_000,
    )
    assert truth["hit_rate"] == truth["prefix_hit_tokens"] / truth["prefix_query_tokens"]


def test_the_cache_panel_gives_the_advice_of_the_shadow_replay(server, page):
    ask(page, "Advice, please.")
    page.locator(".stats").nth(0).filter(has_text="cached").wait_for(timeout=120_000)
    shadow = server.app.state.server.shadow
    while shadow.replayed < shadow.stream.recorded:  # the replay that includes this request
        assert shadow._thread.is_alive(), "the advice stopped"
        shadow._stop.wait(0.05)
    rates = {
        (r["policy"], r["pool_factor"]): r["hit_rate"]
        for r in httpx.get(server.url + "/v1/cache/stats").json()["shadow"]
    }
    policy = server.engine.config.eviction
    pct = [f"{100 * rates[key]:.0f}%" for key in ((policy, 2.0), (policy, 1.0), ("belady-prefix", 1.0))]
    want = f"would have restored {pct[0]} of prompt tokens instead of {pct[1]}; the best possible with this pool is {pct[2]}"
    page.locator("#advice").filter(has_text=want).wait_for(timeout=10_000)


def test_the_page_asks_once_for_the_api_key_and_keeps_it(tiny_model_dir):
    with ServerThread(tiny_settings(tiny_model_dir, api_key="sesame")) as guarded:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page(bypass_csp=True)  # the test evaluates scripts (the page needs none)
            asked: list[str] = []
            page.on("dialog", lambda d: (asked.append(d.message), d.accept("sesame")))
            page.goto(guarded.url + "/")
            page.locator('dd[data-key="pages free"]').wait_for(timeout=30_000)
            ask(page, "Hi!")
            page.locator(".stats").nth(0).filter(has_text="cached").wait_for(timeout=120_000)
            assert len(asked) == 1 and "API key" in asked[0]
            browser.close()


def test_a_machine_without_openblas_is_told_so_at_start_on_health_and_on_the_page(
    tiny_model_dir, monkeypatch, caplog
):
    """Linux without OpenBLAS runs every answer ~60x slower: the log, /health and the page say so, with
    the one command that fixes it; with OpenBLAS none of them does."""
    monkeypatch.setattr(backend, "OPENBLAS_PATH", "/usr/lib/libopenblas.so.0")
    with ServerThread(tiny_settings(tiny_model_dir)) as fast:
        assert "warnings" not in httpx.get(fast.url + "/health").json()
    monkeypatch.setattr(backend, "OPENBLAS_PATH", None)
    with caplog.at_level("WARNING", logger="server.app"), ServerThread(tiny_settings(tiny_model_dir)) as slow:
        health = httpx.get(slow.url + "/health").json()
        assert health["status"] == "ok" and backend.SLOW_BLAS_FIX in health["warnings"][0]
        assert backend.SLOW_BLAS_FIX in caplog.text
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page()
            page.goto(slow.url + "/")
            page.locator("#warning").filter(has_text=backend.SLOW_BLAS_FIX).wait_for(timeout=30_000)
            browser.close()


def test_code_fences_start_a_line_and_inline_backticks_stay_text(page):
    assert page.evaluate("render('use ``` inline, then more')") == "use ``` inline, then more"
    fenced = page.evaluate("render('see:\\n```python\\nx = 1\\n```\\ndone')")
    assert fenced == "see:\n<pre>x = 1\n</pre>done"


def test_with_several_models_the_panel_shows_the_chosen_ones_cache(tmp_path):
    dirs = [make_tiny_model(tmp_path / name, seed=seed) for seed, name in enumerate(("alpha", "beta"))]
    settings = Settings(model=",".join(map(str, dirs)), model_name="alpha,beta", kv_cache_bytes=8 << 20)
    with ServerThread(settings) as s, playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page()
        page.goto(s.url + "/")
        page.locator("#model").select_option("beta")
        ask(page, "Hello beta.")
        page.locator(".stats").nth(0).filter(has_text="cached").wait_for(timeout=120_000)
        s.wait_idle()
        stats = {m: httpx.get(s.url + f"/v1/cache/stats?model={m}").json() for m in ("alpha", "beta")}
        assert stats["alpha"]["prefix_query_tokens"] == 0 < stats["beta"]["prefix_query_tokens"]
        looked_up = str(stats["beta"]["prefix_query_tokens"])
        page.locator('dd[data-key="prompt tokens looked up"]').filter(has_text=looked_up).wait_for(
            timeout=10_000
        )
        assert httpx.get(s.url + "/v1/cache/stats?model=gamma").status_code == 404
        browser.close()
