"""The built-in chat page at GET /, driven in headless Chromium by Playwright.

The real server on the real default model (SmolLM2) answers the streaming,
stop, reload, keyboard and error tests; a scripted stream (page.route, or a
fetch the test feeds chunk by chunk) stands in only where the model cannot be
made to say the thing under test: HTML injection, a think block, a 500.

Chromium is Debian's (/usr/bin/chromium, `make test-ui` installs it as root);
Playwright's own browser download is never used. Screenshots go to each
test's tmp_path; docs/ui-light.png and docs/ui-dark.png are written when they
are missing or IMP_UI_DOCS=1.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = Path(os.environ.get("IMP_CHROMIUM", "/usr/bin/chromium"))
try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:
    pytest.skip("playwright not installed: pip install -e '.[test]'", allow_module_level=True)
if not CHROMIUM.exists():
    pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install -y chromium (make test-ui does it as root)",
                allow_module_level=True)

from imp.http.endpoints.ui import UI_DIR, resolve_static  # noqa: E402
from tests.serverproc import ServerProcess  # noqa: E402

pytestmark = [pytest.mark.ui, pytest.mark.slow]  # slow: the real model, as the e2e lanes

ROOT = Path(__file__).resolve().parent.parent
# the flags this machine needs (docs of the env): no sandbox as root, and no
# background networking, whose connections the closed network refuses
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KV_TOKENS = 2048


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("ui-srv")
    with ServerProcess(smollm2_path, "--kv-cache-tokens", str(KV_TOKENS), log_path=d / "server.out") as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield b
        b.close()


@pytest.fixture
def open_page(browser, tmp_path):
    """open_page(url, width=1100, height=760, scheme="light") -> a page with a fresh
    localStorage; page errors fail the test; a last screenshot lands in tmp_path."""
    made = []

    def make(url, width=1100, height=760, scheme="light", csp=True):
        # csp=False: the page's Content-Security-Policy is ignored, so a test sees
        # what the page's own code does without that second wall
        ctx = browser.new_context(viewport={"width": width, "height": height}, color_scheme=scheme, bypass_csp=not csp)
        page = ctx.new_page()
        page.errors = []
        page.on("pageerror", lambda e: page.errors.append(str(e)))
        page.goto(url + "/")
        until(page, "document.querySelector('#model').options.length > 0")
        made.append((ctx, page))
        return page

    yield make
    for i, (ctx, page) in enumerate(made):
        page.screenshot(path=str(tmp_path / f"final-{i}.png"))
        errors = page.errors
        ctx.close()
        assert not errors, errors


def until(page, expr: str, timeout: float = 30.0):
    """Poll a JS expression from here: page.wait_for_function evaluates its string
    with eval, which the page's CSP (script-src 'self') forbids."""
    deadline = time.monotonic() + timeout
    while True:
        v = page.evaluate(expr)
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout}s: {expr}")
        time.sleep(0.05)


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return json.loads(r.read())


def kv_settled(url: str, timeout: float = 5.0) -> dict:
    """/health once no block is in use (polled: the cancel reaches the scheduler
    a step after the disconnect)."""
    deadline = time.monotonic() + timeout
    while True:
        h = health(url)
        if (h["kv_blocks_used"], h["kv_blocks_reserved"], h["queue_depth"]) == (0, 0, 0) or time.monotonic() > deadline:
            return h
        time.sleep(0.1)


def reply_len(page) -> int:
    """Characters of the newest reply so far."""
    return page.evaluate("([...document.querySelectorAll('.msg.assistant .md')].pop() || {textContent: ''}).textContent.length")


def streaming(page) -> bool:
    return page.is_visible("#stop")


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def wait_done(page, timeout_s: float = 90) -> None:
    page.wait_for_selector("#send", state="visible", timeout=timeout_s * 1000)


def sse(*deltas: dict, usage: dict | None = None) -> str:
    chunks = [{"id": "chatcmpl-test", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d, "finish_reason": None}]}
              for d in deltas]
    chunks.append({"id": "chatcmpl-test", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    if usage:
        chunks.append({"id": "chatcmpl-test", "object": "chat.completion.chunk", "choices": [], "usage": usage})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def scripted(page, body: str, status: int = 200) -> None:
    """Answer the page's next chat requests with `body` (an SSE stream, or an error envelope)."""
    ctype = "text/event-stream" if status == 200 else "application/json"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(status=status, content_type=ctype, body=body))


# A fetch the test feeds chunk by chunk (page.route answers all at once): the
# page's own SSE parser still reads it through a ReadableStream.
FED_FETCH = """
(() => {
  const real = window.fetch.bind(window);
  const enc = new TextEncoder();
  window.__chat = [];
  window.fetch = (url, opts = {}) => {
    if (!String(url).includes('/v1/chat/completions')) return real(url, opts);
    let ctl;
    const stream = new ReadableStream({ start(c) { ctl = c; } });
    window.__chat.push({ headers: Object.fromEntries(new Headers(opts.headers)), body: JSON.parse(opts.body) });
    window.__feed = (obj) => ctl.enqueue(enc.encode('data: ' + JSON.stringify(obj) + '\\n\\n'));
    window.__close = () => { ctl.enqueue(enc.encode('data: [DONE]\\n\\n')); ctl.close(); };
    if (opts.signal) opts.signal.addEventListener('abort', () => ctl.error(new DOMException('aborted', 'AbortError')));
    return Promise.resolve(new Response(stream, { status: 200, headers: { 'Content-Type': 'text/event-stream' } }));
  };
})();
"""


def docs_shot(page, name: str, tmp_path: Path) -> None:
    page.screenshot(path=str(tmp_path / name))
    target = ROOT / "docs" / name
    if os.environ.get("IMP_UI_DOCS") == "1" or not target.exists():
        page.screenshot(path=str(target))


# ---------------------------------------------------------------- serving


def test_page_and_static_files_are_served_confined(server):
    with urllib.request.urlopen(server.url + "/") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
        assert r.headers["Cache-Control"] == "no-cache"
        assert "script-src 'self'" in r.headers["Content-Security-Policy"]
        assert b'<script src="/ui/app.js"' in r.read()
    for name, ctype in [("app.js", "text/javascript"), ("md.js", "text/javascript"), ("style.css", "text/css")]:
        with urllib.request.urlopen(f"{server.url}/ui/{name}") as r:
            assert r.headers["Content-Type"].startswith(ctype) and r.headers["Cache-Control"] == "no-cache"
            assert r.read() == (UI_DIR / name).read_bytes()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("HEAD", "/")  # Claude Code probes it
    r = conn.getresponse()
    assert r.status == 200 and r.read() == b"" and int(r.headers["Content-Length"]) > 0
    # raw paths, sent as written (no client-side normalisation)
    for path in ["/ui/../ui.py", "/ui/..%2fui.py", "/ui/%2e%2e%2fui.py", "/ui/%2e%2e", "/ui/%2fetc%2fpasswd",
                 "/ui//etc/passwd", "/ui/", "/ui/missing.js", "/ui/.hidden", "/ui/..%5c..%5capp.py"]:
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read()
        assert r.status == 404 and b"import" not in body, (path, r.status)
    conn.close()


def test_resolve_static_refuses_traversal_and_symlinks_out(tmp_path):
    root = tmp_path / "ui"
    root.mkdir()
    (root / "ok.js").write_text("1")
    (tmp_path / "secret.txt").write_text("no")
    (root / "out.txt").symlink_to(tmp_path / "secret.txt")
    (root / "in.js").symlink_to(root / "ok.js")  # a link that stays inside is fine
    (root / "sub").mkdir()
    assert resolve_static(root, "ok.js") == (root / "ok.js").resolve()
    assert resolve_static(root, "in.js") == (root / "ok.js").resolve()
    for bad in ["out.txt", "../secret.txt", "..", "sub", "/etc/passwd", "sub/x.js", "ok.exe", "", ".ok.js", "nope.js"]:
        assert resolve_static(root, bad) is None, bad


# ---------------------------------------------------------------- real model


def test_streams_incrementally_shows_figures_and_survives_reload(server, open_page, tmp_path):
    page = open_page(server.url)
    assert page.input_value("#model").startswith("SmolLM2")
    page.fill("#max_tokens", "48")
    page.fill("#seed", "7")
    send(page, "Tell me about the moon in three sentences.")
    lengths = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        n, live = reply_len(page), streaming(page)
        if not live:
            break
        lengths.append(n)
        if n and len(lengths) % 10 == 0:
            page.screenshot(path=str(tmp_path / f"stream-{len(lengths)}.png"))
        time.sleep(0.05)
    wait_done(page)
    final = reply_len(page)
    grown = sorted(set(n for n in lengths if n > 0))
    # tokens arrived in several steps while the Stop button was up, not all at the end
    assert len(grown) >= 3 and grown[0] < final, lengths
    stats = page.inner_text(".msg.assistant .stats")
    assert re.fullmatch(r"\d+ tokens · [\d.]+ tok/s · TTFT \d+ ms · \d+ cached of \d+ prompt tokens( · finish: length)?", stats), stats
    text = page.inner_text(".msg.assistant .md")
    # the live panel reads /health and /v1/metrics
    blocks = health(server.url)["kv_blocks_total"]
    expect(page.locator("#live-kv")).to_have_text(f"KV 0/{blocks} (0%)", timeout=10_000)
    expect(page.locator("#live-rate")).to_contain_text("tok/s")
    page.reload()
    page.wait_for_selector(".msg.assistant")
    assert page.inner_text(".msg.user .text") == "Tell me about the moon in three sentences."
    assert page.inner_text(".msg.assistant .md") == text
    assert page.inner_text(".msg.assistant .stats") == stats
    expect(page.locator("#convs li.active .conv-title")).to_have_text("Tell me about the moon in three sentences.")
    assert page.input_value("#max_tokens") == "48"  # settings are kept too


def stop_and_check_kv(server, page, how, tmp_path) -> dict:
    page.fill("#max_tokens", "")  # the rest of the context: it would run for minutes
    page.fill("#seed", "1")  # a prompt and seed SmolLM2 answers at length (300+ tokens)
    send(page, "Write a long story about a dragon who learns to fly. Make it at least 800 words.")
    until(page, "[...document.querySelectorAll('.msg.assistant .md')].pop().textContent.length > 40", 60)
    during = health(server.url)
    assert during["kv_blocks_used"] > 0, during
    how()
    wait_done(page, 5)
    cut = reply_len(page)
    after = kv_settled(server.url)
    time.sleep(0.5)
    page.screenshot(path=str(tmp_path / "stopped.png"))
    assert reply_len(page) == cut  # nothing arrives after the stop
    assert "stopped" in page.locator(".msg.assistant .stats").last.inner_text()
    print(f"\nKV during: {during['kv_blocks_used']} used / {during['kv_blocks_total']};"
          f" after stop: used={after['kv_blocks_used']} reserved={after['kv_blocks_reserved']}"
          f" free={after['kv_blocks_free']} queue={after['queue_depth']} cancellations={after['cancellations']}")
    assert (after["kv_blocks_used"], after["kv_blocks_reserved"], after["queue_depth"]) == (0, 0, 0), after
    assert after["kv_blocks_free"] == after["kv_blocks_total"]
    return after


def test_stop_button_cancels_and_frees_kv(server, open_page, tmp_path):
    page = open_page(server.url)
    before = health(server.url)["cancellations"]
    after = stop_and_check_kv(server, page, lambda: page.click("#stop"), tmp_path)
    assert after["cancellations"] == before + 1  # the server saw the disconnect as a cancel
    # the conversation goes on after a stop: the partial reply is history
    page.fill("#max_tokens", "8")
    send(page, "Thanks.")
    wait_done(page)
    assert page.locator(".msg.assistant").count() == 2


def test_keyboard_enter_shift_enter_escape(server, open_page, tmp_path):
    page = open_page(server.url)
    page.fill("#max_tokens", "4")
    page.click("#input")
    page.keyboard.type("first line")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("second line")
    assert page.input_value("#input") == "first line\nsecond line"
    assert page.locator(".msg").count() == 0  # Shift+Enter sent nothing
    page.keyboard.press("Enter")
    wait_done(page)
    assert page.inner_text(".msg.user .text") == "first line\nsecond line"
    assert page.input_value("#input") == ""
    # Esc stops a running reply
    stop_and_check_kv(server, page, lambda: page.keyboard.press("Escape"), tmp_path)


def test_error_banners_from_the_real_server(server, open_page, tmp_path):
    page = open_page(server.url)
    long_prompt = "hello " * 9000  # over SmolLM2's 8192-token context
    send(page, long_prompt)
    banner = page.locator("#banner")
    expect(banner).to_be_visible(timeout=30_000)
    expect(banner).to_contain_text("400")
    expect(banner).to_contain_text("8192 maximum")
    page.screenshot(path=str(tmp_path / "error-banner.png"))
    assert page.locator(".msg").count() == 0  # the failed turn is taken back ...
    assert page.input_value("#input") == long_prompt  # ... and its text handed back to edit
    page.click("#banner-close")
    expect(banner).to_be_hidden()
    page.fill("#temperature", "7")
    send(page, "hi")
    expect(banner).to_contain_text("'temperature' must be <= 2")
    page.fill("#temperature", "")
    page.fill("#max_tokens", "4")
    send(page, "hi")
    wait_done(page)
    expect(banner).to_be_hidden()  # a new send clears the last error
    assert page.locator(".msg.assistant").count() == 1


# ---------------------------------------------------------------- scripted replies

INJECTION = (
    'Here: <script>window.__pwned=1</script> and <img src=x onerror="window.__pwned=1"> end.\n\n'
    "**bold** and <b>raw b</b> and [a link](javascript:window.__pwned=1) and [ok](https://example.com/x)\n\n"
    "```html\n<script>window.__pwned=1</script>\n<img src=x onerror=\"window.__pwned=1\">\n```\n"
    "| a | b |\n|---|---|\n| <svg onload=window.__pwned=1> | `x` |\n"
)


@pytest.mark.parametrize("csp", [True, False], ids=["with-csp", "renderer-alone"])
def test_model_output_cannot_inject_html(server, open_page, tmp_path, csp):
    page = open_page(server.url, csp=csp)
    # one token per delta, split inside the tags, as a stream would
    pieces = [INJECTION[i:i + 7] for i in range(0, len(INJECTION), 7)]
    scripted(page, sse({"role": "assistant", "content": ""}, *({"content": p} for p in pieces),
                       usage={"prompt_tokens": 9, "completion_tokens": len(pieces), "total_tokens": 9 + len(pieces),
                              "prompt_tokens_details": {"cached_tokens": 0}}))
    send(page, '<img src=y onerror="window.__pwned=2"> please repeat')
    wait_done(page, 10)
    page.wait_for_timeout(300)  # an onerror would have fired by now

    def check():
        assert page.evaluate("typeof window.__pwned") == "undefined"
        reply = page.locator(".msg.assistant .md")
        assert page.locator(".messages img, .messages script, .messages svg, .messages b").count() == 0
        assert page.locator(".messages a[href^='javascript']").count() == 0
        text = reply.inner_text()
        assert reply.locator("p").first.inner_text() == INJECTION.split("\n")[0]  # every character, as written
        assert reply.locator(".code pre code").inner_text() == (
            '<script>window.__pwned=1</script>\n<img src=x onerror="window.__pwned=1">')
        assert "<b>raw b</b>" in text and "[a link](javascript:window.__pwned=1)" in text
        assert "<svg onload=window.__pwned=1>" in text
        assert reply.locator("strong").inner_text() == "bold"  # markdown still renders
        assert reply.locator("a").get_attribute("href") == "https://example.com/x"
        assert page.inner_text(".msg.user .text") == '<img src=y onerror="window.__pwned=2"> please repeat'

    check()
    page.screenshot(path=str(tmp_path / "injection.png"))
    page.unroute("**/v1/chat/completions")
    page.reload()  # and again from localStorage
    page.wait_for_selector(".msg.assistant .code")
    page.wait_for_timeout(300)
    check()


MARKDOWN = [
    ("# Head\nline one\nline two", "<h3>Head</h3><p>line one<br>line two</p>"),
    ("- a\n- b\n  - c\n1. x", "<ul><li>a</li><li>b<ul><li>c</li></ul></li></ul><ol><li>x</li></ol>"),
    ("use `a<b>` and snake_case_name, 2 * 3 * 4, x__y__z", "<p>use <code>a&lt;b&gt;</code> and snake_case_name, 2 * 3 * 4, x__y__z</p>"),
    ("*em* _em_ **b** ~~s~~", "<p><em>em</em> <em>em</em> <strong>b</strong> <del>s</del></p>"),
    ("> quoted\n\n---", "<blockquote><p>quoted</p></blockquote><hr>"),
    ("see https://example.com/a.", '<p>see <a href="https://example.com/a" target="_blank" rel="noopener noreferrer nofollow">https://example.com/a</a>.</p>'),
    ("![pic](https://example.com/p.png)", '<p><a href="https://example.com/p.png" target="_blank" rel="noopener noreferrer nofollow">image: pic</a></p>'),
    ("[x](data:text/html,<b>)", "<p>[x](data:text/html,&lt;b&gt;)</p>"),
    ("| a | b |\n|:-|-:|\n| 1 | 2 |", '<div class="table-wrap"><table><thead><tr><th style="text-align: left;">a</th>'
     '<th style="text-align: right;">b</th></tr></thead><tbody><tr><td style="text-align: left;">1</td>'
     '<td style="text-align: right;">2</td></tr></tbody></table></div>'),
]


def test_markdown_renderer(server, open_page):
    page = open_page(server.url)
    render = "t => { const d = document.createElement('div'); d.append(window.impMarkdown.render(t)); return d.innerHTML; }"
    for src, html in MARKDOWN:
        assert page.evaluate(render, src) == html, src
    # a fence still open while the reply streams is already a code block
    code = page.evaluate("t => { const d = document.createElement('div'); d.append(window.impMarkdown.render(t));"
                         " return [d.querySelector('.code-lang').textContent, d.querySelector('pre code').textContent]; }",
                         "Here:\n```js\nlet a = 1 < 2;\nlet b")
    assert code == ["js", "let a = 1 < 2;\nlet b"]


def test_think_block_and_end_thinking(server, open_page, tmp_path):
    page = open_page(server.url)
    page.add_init_script(FED_FETCH)
    page.reload()
    until(page, "document.querySelector('#model').options.length > 0")
    ended = []
    page.route("**/v1/requests/*/end_thinking",
               lambda route: (ended.append((route.request.method, route.request.url)),
                              route.fulfill(status=200, content_type="application/json", body='{"ended": true}')))
    send(page, "Think first.")
    until(page, "window.__chat.length === 1")
    chunk = lambda delta: page.evaluate("d => window.__feed({id: 'chatcmpl-x', choices: [{index: 0, delta: d, finish_reason: null}]})", delta)  # noqa: E731
    chunk({"role": "assistant", "content": ""})
    for piece in ["Let me ", "think <b>hard</b> ", "about it."]:
        chunk({"reasoning_content": piece})
    think = page.locator(".msg.assistant .think")
    expect(think.locator("details")).to_have_attribute("open", "")
    expect(think.locator(".think-body")).to_have_text("Let me think <b>hard</b> about it.")
    page.screenshot(path=str(tmp_path / "thinking.png"))
    think.locator(".end-think").click()
    until(page, "document.querySelector('.end-think').textContent === 'Ending…'")
    rid = page.evaluate("window.__chat[0].headers['x-request-id']")
    assert rid.startswith("ui-")
    assert ended == [("POST", f"{server.url}/v1/requests/{rid}/end_thinking")]
    chunk({"content": "The answer is 42."})
    page.evaluate("window.__close()")
    wait_done(page, 10)
    expect(page.locator(".msg.assistant .md")).to_have_text("The answer is 42.")
    assert page.get_attribute(".msg.assistant .think details", "open") is None  # folded once the answer began
    expect(think.locator(".end-think")).to_be_hidden()
    think.locator("summary").click()  # the thoughts are still there to read
    expect(think.locator(".think-body")).to_be_visible()
    body = page.evaluate("window.__chat[0].body")
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": "Think first."}]


def test_request_carries_sampling_controls_and_system_prompt(server, open_page):
    page = open_page(server.url)
    page.add_init_script(FED_FETCH)
    page.reload()
    until(page, "document.querySelector('#model').options.length > 0")
    for sel, v in [("#system", "Be brief."), ("#temperature", "0.3"), ("#top_p", "0.9"), ("#max_tokens", "12"), ("#seed", "5")]:
        page.fill(sel, v)
    send(page, "Hello")
    until(page, "window.__chat.length === 1")
    page.evaluate("window.__close()")
    body = page.evaluate("window.__chat[0].body")
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"]) == (0.3, 0.9, 12, 5)
    assert body["model"].startswith("SmolLM2")


def test_500_banner_and_conversations_new_delete(server, open_page):
    page = open_page(server.url)
    scripted(page, json.dumps({"error": {"message": "engine step failed: boom", "type": "server_error", "code": "engine_step_failed"}}),
             status=500)
    send(page, "one")
    expect(page.locator("#banner")).to_contain_text("Server error 500 (engine_step_failed): engine step failed: boom")
    page.unroute("**/v1/chat/completions")
    scripted(page, sse({"content": "reply one"}))
    send(page, "one")
    wait_done(page, 10)
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0
    page.unroute("**/v1/chat/completions")
    scripted(page, sse({"content": "reply two"}))
    send(page, "two")
    wait_done(page, 10)
    titles = page.locator("#convs .conv-title")
    expect(titles).to_have_text(["two", "one"])
    page.click("#convs li:nth-child(2) .conv-title")
    expect(page.locator(".msg.assistant .md")).to_have_text("reply one")
    page.reload()
    expect(page.locator(".msg.assistant .md")).to_have_text("reply one")  # the open conversation is remembered
    delete = page.locator("#convs li:nth-child(2) .conv-del")
    delete.click()
    expect(delete).to_have_text("Delete?")  # the first click only arms it
    delete.click()
    expect(titles).to_have_text(["two"])
    page.reload()
    expect(titles).to_have_text(["two"])
    expect(page.locator(".msg.assistant .md")).to_have_text("reply two")


def test_phone_width(server, open_page, tmp_path):
    page = open_page(server.url, width=375, height=740)
    side = page.locator("#side")
    assert side.bounding_box()["x"] + side.bounding_box()["width"] <= 0  # the drawer is shut
    long_line = "x = " + "1 + " * 80 + "1"
    scripted(page, sse({"content": f"# Title\n\nSome text.\n\n```python\n{long_line}\n```\n\n| a | b | c | d |\n|---|---|---|---|\n| {'w' * 40} | 2 | 3 | 4 |\n"}))
    send(page, "show me code")
    wait_done(page, 10)
    # nothing pushes the page sideways: wide code and tables scroll inside their boxes
    assert page.evaluate("document.documentElement.scrollWidth") <= 375
    assert page.locator("#send").bounding_box()["x"] + page.locator("#send").bounding_box()["width"] <= 375
    page.screenshot(path=str(tmp_path / "phone.png"))
    page.click("#menu")
    expect(page.locator("#menu")).to_have_attribute("aria-expanded", "true")
    page.wait_for_timeout(300)  # the slide-in
    box = side.bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 375
    page.screenshot(path=str(tmp_path / "phone-drawer.png"))
    page.keyboard.press("Escape")
    expect(page.locator("#menu")).to_have_attribute("aria-expanded", "false")


def test_screenshots_light_mid_stream_and_dark(server, open_page, tmp_path):
    for scheme in ("light", "dark"):
        page = open_page(server.url, scheme=scheme)
        page.fill("#seed", "3")
        page.fill("#temperature", "0.3")
        page.fill("#max_tokens", "160" if scheme == "light" else "90")
        if scheme == "dark":  # a finished turn with figures, then the screenshot
            send(page, "Write a Python function that reverses a string, in a code block.")
            wait_done(page)
            docs_shot(page, "ui-dark.png", tmp_path)
        else:
            send(page, "Give me three tips for learning to cook, as a numbered list with a short sentence each.")
            # the latest frame that is still streaming, once a fair part of the reply is in
            shot, deadline = 0, time.monotonic() + 90
            while streaming(page) and shot < 300 and time.monotonic() < deadline:
                n = reply_len(page)
                if n > 150:
                    page.screenshot(path=str(tmp_path / "ui-light.png"))
                    shot = n
                time.sleep(0.05)
            assert shot, "the reply ended before a mid-stream screenshot"
            target = ROOT / "docs" / "ui-light.png"
            if os.environ.get("IMP_UI_DOCS") == "1" or not target.exists():
                target.write_bytes((tmp_path / "ui-light.png").read_bytes())
            page.keyboard.press("Escape")
            wait_done(page, 5)
        bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert bg == ("rgb(246, 246, 248)" if scheme == "light" else "rgb(19, 20, 24)"), bg


# ---------------------------------------------------------------- API key


def test_api_key_field(smollm2_path, browser, tmp_path):
    with ServerProcess(smollm2_path, "--kv-cache-tokens", "1024", "--api-key", "sekret-ui",
                       log_path=tmp_path / "server.out") as srv:
        try:
            urllib.request.urlopen(srv.url + "/", timeout=5).close()
        except urllib.error.HTTPError as e:
            if e.code == 401:
                pytest.skip("GET / answers 401 with --api-key: imp/http/app.py does not exempt the UI yet")
            raise
        ctx = browser.new_context(viewport={"width": 1100, "height": 760})
        page = ctx.new_page()
        auth = []
        page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and auth.append(r.headers.get("authorization")))
        page.goto(srv.url + "/")
        banner = page.locator("#banner")
        expect(banner).to_contain_text("401")
        expect(banner).to_contain_text("API key")
        expect(page.locator("#api-key")).to_be_focused()
        page.screenshot(path=str(tmp_path / "api-key-401.png"))
        page.fill("#api-key", "sekret-ui")
        page.press("#api-key", "Tab")  # change event: models are listed again with the key
        until(page, "document.querySelector('#model').options.length > 0")
        expect(banner).to_be_hidden()
        page.fill("#max_tokens", "6")
        send(page, "Hi")
        wait_done(page)
        assert page.inner_text(".msg.assistant .md").strip()
        assert auth == ["Bearer sekret-ui"]
        page.screenshot(path=str(tmp_path / "api-key.png"))
        ctx.close()
