"""`diffspec serve`: a live server on 127.0.0.1 (uvicorn in a background thread) over tiny random models.

The main server drafts with the target itself (an AR drafter that accepts everything, gamma 4), so
every round emits a block of 5 tokens: stop strings are tested inside one block and across two.
The slow server drafts nothing but sleeps 50 ms per round and has no stop tokens, so a request
runs exactly as long as asked: it makes queueing and disconnects observable. The alternating server
self-drafts too, with a policy that switches speculation off every other round.
"""

from __future__ import annotations

import concurrent.futures
import random
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from helpers import AlternatingPolicy
from diffspec import AutoregressiveDrafter, Draft, FixedPolicy, SamplingParams, SpeculativeEngine, Target
from diffspec.drafters.base import Drafter
from diffspec.server import ServerConfig, ServerThread
from diffspec.server.stops import StopMatcher

KEY = "sk-test"
GREEDY = SamplingParams()


class SleepyDrafter(Drafter):
    """Proposes nothing, slowly: one round = 50 ms + one target token."""

    name = "sleepy"

    def propose(self, context, policy, limit, sampling, generator):
        time.sleep(0.05)
        return Draft.empty()


def self_drafting(model, tok):
    return SpeculativeEngine(Target(model, tok, name="tiny"), AutoregressiveDrafter(model, tok), FixedPolicy(4))


def no_stop_target(model, tok):
    target = Target(model, tok, name="tiny")
    target.stop_token_ids = frozenset()  # generation runs to max_tokens
    return target


@pytest.fixture(scope="module")
def server(tiny_model, tokenizer):
    with ServerThread(self_drafting(tiny_model, tokenizer), ServerConfig("tiny", api_key=KEY, max_queue=16)) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(tiny_model, tokenizer):
    """A second engine like the server's (its own caches): the expected outputs."""
    return self_drafting(tiny_model, tokenizer)


@pytest.fixture(scope="module")
def slow_server(tiny_model, tokenizer):
    engine = SpeculativeEngine(no_stop_target(tiny_model, tokenizer), SleepyDrafter(), FixedPolicy(1))
    with ServerThread(engine, ServerConfig("tiny", max_queue=1)) as srv:
        yield srv


@pytest.fixture(scope="module")
def alternating_server(tiny_model, tokenizer):
    engine = SpeculativeEngine(Target(tiny_model, tokenizer, name="tiny"), AutoregressiveDrafter(tiny_model, tokenizer),
                               AlternatingPolicy(gamma=3))
    with ServerThread(engine, ServerConfig("tiny")) as srv:
        yield srv


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def chat(content):
    return [{"role": "user", "content": content}]


def check_round_fields(spec, result=None):
    """A `speculative` object's speculation-off count and draft-length histogram agree with its other
    figures, and with the engine's own result when one is given."""
    hist, off = spec["draft_length_histogram"], spec["speculation_off_rounds"]
    assert sum(hist.values()) == spec["rounds"] and all(isinstance(k, str) for k in hist)
    assert sum(int(k) * n for k, n in hist.items()) == spec["drafted_tokens"]
    assert 0 <= off <= hist.get("0", 0)
    if result is not None:
        assert spec["rounds"] == result.num_rounds and off == result.speculation_off_rounds
        assert spec["hidden_state_rounds"] == result.hidden_state_rounds
        assert hist == result.stats_dict()["draft_length_histogram"]


def metrics(srv) -> dict:
    out = {}
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def stream_chat(client, content, **kw):
    chunks = list(client.chat.completions.create(model="tiny", messages=chat(content), stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# --- OpenAI client, exactness ---------------------------------------------------------------
def test_openai_client_matches_engine_generate(client, reference):
    eos = reference.generate("w5 w6 w7 w5 w6", max_new_tokens=24, sampling=GREEDY)  # ends on the stop token
    prompt = "w9 w4 w9 w4"
    ref = reference.generate(prompt, max_new_tokens=24, sampling=GREEDY)  # runs to the length limit
    assert (eos.finish_reason, ref.finish_reason) == ("stop", "length") and ref.mean_accepted_length > 1
    for p, r in (("w5 w6 w7 w5 w6", eos), (prompt, ref)):
        out = client.chat.completions.create(model="tiny", messages=chat(p), max_tokens=24, temperature=0)
        assert out.choices[0].message.content == r.text
        assert out.choices[0].finish_reason == r.finish_reason
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(r.prompt_token_ids), len(r.token_ids))
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
        spec = out.speculative
        assert spec["drafted_tokens"] == r.drafted_tokens and spec["accepted_tokens"] == r.accepted_tokens
        assert spec["mean_accepted_length"] == pytest.approx(r.mean_accepted_length, abs=1e-3)
        check_round_fields(spec, r)
        assert spec["speculation_off_rounds"] == 0 and spec["draft_length_histogram"].get("4", 0) > 0  # fixed gamma 4

    text, chunks = stream_chat(client, prompt, max_completion_tokens=24, temperature=0,
                               stream_options={"include_usage": True})
    assert text == ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    check_round_fields(chunks[-1].speculative, ref)

    raw = reference.generate("w1 w2 w3", max_new_tokens=12, sampling=GREEDY, chat=False)
    assert raw.text
    comp = client.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=12, temperature=0)
    assert comp.choices[0].text == raw.text and comp.usage.completion_tokens == len(raw.token_ids)
    streamed = client.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == raw.text
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_eight_concurrent_streaming_clients(server, reference):
    prompts = [f"w{i} w{i + 3} w{i + 1}" for i in range(8)]
    expected = [reference.generate(p, max_new_tokens=20, sampling=GREEDY).text for p in prompts]
    assert all(expected) and len(set(expected)) > 1

    def one(prompt):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        return stream_chat(c, prompt, max_tokens=20, temperature=0)[0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, prompts)) == expected


# --- stop strings -----------------------------------------------------------------------------
def _stop_case(reference, where):
    """(prompt, stop string, expected text, expected completion tokens) for a stop inside or across blocks."""
    prompt = "w9 w4 w9 w4"
    ref = reference.generate(prompt, max_new_tokens=30, sampling=GREEDY)
    decode = reference.target.decode
    assert len(ref.rounds) >= 3 and ref.rounds[0].emitted == ref.rounds[1].emitted == 5
    b1, b2 = len(decode(ref.token_ids[:5])), len(decode(ref.token_ids[:10]))  # block ends in the text
    start, stop = (b1 - 2, ref.text[b1 - 2: b1 + 3]) if where == "across" else (b1 + 2, ref.text[b1 + 2: b2 - 1])
    assert ref.text.find(stop) == start and len(stop) >= 3
    m = next(m for m in range(len(ref.token_ids) + 1) if len(decode(ref.token_ids[:m])) >= start)
    return prompt, stop, ref.text[:start], m


@pytest.mark.parametrize("where", ["inside", "across"])
def test_stop_strings_never_leak(client, reference, where):
    prompt, stop, expected, tokens = _stop_case(reference, where)
    out = client.chat.completions.create(model="tiny", messages=chat(prompt), max_tokens=30, temperature=0,
                                         stop=["no-such-text", stop])
    assert out.choices[0].message.content == expected and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == tokens
    text, chunks = stream_chat(client, prompt, max_tokens=30, temperature=0, stop=stop,
                               stream_options={"include_usage": True})
    assert text == expected and chunks[-1].usage.completion_tokens == tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_stop_matcher_any_split():
    text = "the cat sat on the mat. the end"
    rng = random.Random(0)
    for stops, expected in [(["mat."], "the cat sat on the "), (["xyz", "at on"], "the cat s"),
                            (["the end", "e m"], "the cat sat on th"), (["zzz"], text), (["t", "th"], "")]:
        for _ in range(50):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 8)))
            blocks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            m, out = StopMatcher(stops), ""
            for block in blocks:
                out += m.feed(block)
                assert expected.startswith(out)  # never a character past the cut
            out += m.flush()
            assert out == expected and m.released_chars == len(expected) and m.stopped == (expected != text)


# --- bad input ----------------------------------------------------------------------------------
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
BASE = {"model": "tiny", "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 2}
BAD = [
    (CHAT, {**BASE, "n": 2}, 400, "'n' is not supported"),
    (CHAT, {**BASE, "logprobs": True}, 400, "'logprobs' is not supported"),
    (CHAT, {**BASE, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "'tools' is not supported"),
    (CHAT, {**BASE, "frequency_penalty": 0.5}, 400, "'frequency_penalty' is not supported"),
    (CHAT, {**BASE, "presence_penalty": 1}, 400, "'presence_penalty' is not supported"),
    (CHAT, {**BASE, "logit_bias": {"5": 10}}, 400, "'logit_bias' is not supported"),
    (CHAT, {**BASE, "response_format": {"type": "json_object"}}, 400, "'response_format' is not supported"),
    (CHAT, {**BASE, "frobnicate": 1}, 400, "unrecognized request argument 'frobnicate'"),
    (CHAT, {**BASE, "temperature": -0.5}, 400, "'temperature' must be >= 0"),
    (CHAT, {**BASE, "temperature": "hot"}, 400, "'temperature' must be a finite number"),
    (CHAT, {**BASE, "top_p": 0}, 400, "'top_p' must be in (0, 1]"),
    (CHAT, {**BASE, "top_p": 1.5}, 400, "'top_p' must be in (0, 1]"),
    (CHAT, {**BASE, "max_tokens": 0}, 400, "'max_tokens' must be an integer >= 1"),
    (CHAT, {**BASE, "max_tokens": 5000}, 400, "lower max_tokens to at most"),
    (CHAT, {**BASE, "messages": chat("w1 " * 300)}, 400, "more than fits in the model's context of 256"),
    (CHAT, {**BASE, "messages": []}, 400, "'messages' is required"),
    (CHAT, {**BASE, "messages": [{"role": "tool", "content": "x"}]}, 400, "role 'tool' is not supported"),
    (CHAT, {**BASE, "stop": ""}, 400, "'stop' must be"),
    (CHAT, {**BASE, "stream_options": {"include_usage": True}}, 400, "only allowed with 'stream': true"),
    (CHAT, {**BASE, "seed": -1}, 400, "'seed' must be >= 0"),
    (CHAT, {**BASE, "model": "gpt-4"}, 404, "model 'gpt-4' is not served here"),
    (CHAT, ["not", "an", "object"], 400, "must be a JSON object"),
    (CHAT, b"{not json", 400, "not valid JSON"),
    (COMP, {"model": "tiny", "prompt": "w1", "echo": True}, 400, "'echo' is not supported"),
    (COMP, {"model": "tiny", "prompt": "w1", "best_of": 3}, 400, "'best_of' is not supported"),
    (COMP, {"model": "tiny", "prompt": "w1", "logprobs": 1}, 400, "'logprobs' is not supported"),
    (COMP, {"model": "tiny", "prompt": ["w1", "w2"]}, 400, "several prompts in one request"),
    (COMP, {"model": "tiny", "prompt": "  "}, 400, "prompt is empty"),
]


@pytest.mark.parametrize("path,body,status,message", BAD, ids=[f"{i}-{b[3][:24]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_status_and_message(server, path, body, status, message):
    headers = {"Authorization": f"Bearer {KEY}"}
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={**headers, "Content-Type": "application/json"})
    else:
        r = httpx.post(server.url + path, json=body, headers=headers)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]


def test_api_key_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + CHAT, json=BASE, headers=headers)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.post(server.url + CHAT, json={**BASE, "n": 1, "presence_penalty": 0, "user": "u"},
                      headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_metrics_counters_move(client, server):
    before = metrics(server)
    out = client.chat.completions.create(model="tiny", messages=chat("w3 w8 w3"), max_tokens=10, temperature=0)
    httpx.post(server.url + CHAT, json={**BASE, "top_p": 2}, headers={"Authorization": f"Bearer {KEY}"})
    after = metrics(server)

    def moved(name):
        return after.get(name, 0) - before.get(name, 0)

    assert moved('diffspec_requests_total{endpoint="chat",code="200"}') == 1
    assert moved('diffspec_requests_total{endpoint="chat",code="400"}') == 1
    assert moved("diffspec_prompt_tokens_total") == out.usage.prompt_tokens
    assert moved("diffspec_generation_tokens_total") == out.usage.completion_tokens
    assert moved("diffspec_drafted_tokens_total") == out.speculative["drafted_tokens"] > 0
    assert moved("diffspec_accepted_tokens_total") == out.speculative["accepted_tokens"]
    assert moved("diffspec_engine_rounds_total") == out.speculative["rounds"]
    assert "diffspec_speculation_off_rounds_total" in after  # exported from the start, also while 0
    assert moved("diffspec_speculation_off_rounds_total") == out.speculative["speculation_off_rounds"] == 0
    assert moved("diffspec_request_latency_seconds_count") == 1 == moved("diffspec_time_to_first_token_seconds_count")
    assert after["diffspec_mean_accepted_length"] > 1 and after["diffspec_queue_depth"] == 0
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_speculation_off_rounds_reach_the_response_and_the_metrics(alternating_server, reference):
    """Every other round is a plain step by the policy's choice: the response says how many, the
    metrics count them, and the text is still the target's greedy text."""
    c = openai.OpenAI(base_url=alternating_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = "w9 w4 w9 w4"
    ref = reference.generate(prompt, max_new_tokens=24, sampling=GREEDY)
    before = metrics(alternating_server)
    out = c.chat.completions.create(model="tiny", messages=chat(prompt), max_tokens=24, temperature=0)
    after = metrics(alternating_server)
    assert out.choices[0].message.content == ref.text and out.usage.completion_tokens == len(ref.token_ids)
    spec = out.speculative
    check_round_fields(spec)
    off = spec["speculation_off_rounds"]
    assert off > 0 and abs(off - spec["rounds"] // 2) <= 1
    assert spec["drafted_tokens"] > 0 and spec["accepted_tokens"] == spec["drafted_tokens"]  # self-drafting
    moved = after["diffspec_speculation_off_rounds_total"] - before.get("diffspec_speculation_off_rounds_total", 0)
    assert moved == off
    assert after["diffspec_engine_rounds_total"] - before.get("diffspec_engine_rounds_total", 0) == spec["rounds"]

    text, chunks = stream_chat(c, prompt, max_tokens=24, temperature=0, stream_options={"include_usage": True})
    assert text == ref.text
    assert chunks[-1].speculative == spec  # the same request again: the same rounds
    assert metrics(alternating_server)["diffspec_speculation_off_rounds_total"] == after[
        "diffspec_speculation_off_rounds_total"] + off


# --- load and faults (slow server) --------------------------------------------------------------
def test_full_queue_gets_429_and_health_answers(slow_server, tiny_model, tokenizer):
    ref = SpeculativeEngine(no_stop_target(tiny_model, tokenizer)).generate("w3 w4", max_new_tokens=3, chat=False)
    url = slow_server.url
    queued = {"model": "tiny", "prompt": "w3 w4", "max_tokens": 3, "temperature": 0}
    with httpx.Client(timeout=60) as http, concurrent.futures.ThreadPoolExecutor(1) as pool:
        with http.stream("POST", url + COMP, json={**queued, "max_tokens": 150, "stream": True}) as long:
            assert long.status_code == 200
            wait_for(lambda: httpx.get(url + "/health").json()["running"] == 1)
            waiting = pool.submit(httpx.post, url + COMP, json=queued, timeout=60)
            wait_for(lambda: httpx.get(url + "/health").json()["queue_depth"] == 1)
            t0 = time.perf_counter()
            assert httpx.get(url + "/metrics").status_code == 200 and time.perf_counter() - t0 < 1.0
            full = httpx.post(url + COMP, json=queued)
            assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
            assert "--max-queue" in full.json()["error"]["message"]
        # leaving the long stream cancels it; the queued request then gets its full answer
        answer = waiting.result(timeout=30)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == ref.text
    assert answer.json()["usage"]["completion_tokens"] == 3


def test_disconnect_stops_generation(slow_server):
    url = slow_server.url
    before = metrics(slow_server)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url + COMP, json={"model": "tiny", "prompt": "w1 w2", "max_tokens": 200,
                                                   "temperature": 0, "stream": True}) as r:
            assert any(line.startswith("data: {") for line in r.iter_lines())  # the first text arrived
    # the connection is closed mid-stream (200 tokens would take 10 s)
    key = 'diffspec_requests_finished_total{reason="cancelled"}'
    wait_for(lambda: metrics(slow_server)[key] == before.get(key, 0) + 1, timeout=5)
    after = metrics(slow_server)
    assert after["diffspec_engine_tokens_total"] - before.get("diffspec_engine_tokens_total", 0) < 40
    assert after["diffspec_requests_running"] == 0
    time.sleep(0.3)
    assert metrics(slow_server)["diffspec_engine_rounds_total"] == after["diffspec_engine_rounds_total"]


# --- the command line ------------------------------------------------------------------------
def test_cli_serve_starts_prints_url_and_answers(tiny_model_dir):
    proc = subprocess.Popen([sys.executable, "-m", "diffspec", "serve", "--model", str(tiny_model_dir), "--port", "0",
                             "--drafter", "prompt-lookup", "--policy", "fixed", "--log-level", "warning"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        line = proc.stderr.readline()
        while line and "diffspec serve: http://127.0.0.1:" not in line:
            line = proc.stderr.readline()
        assert line, "the server exited before printing its URL"
        url = line.split()[2].removesuffix("/v1")
        assert httpx.get(url + "/health").json()["status"] == "ok"
        r = httpx.post(url + COMP, json={"prompt": "w1 w2", "max_tokens": 4, "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_cli_serve_port_in_use_is_one_line_error(server):
    port = server.url.rsplit(":", 1)[1]
    proc = subprocess.run([sys.executable, "-m", "diffspec", "serve", "--port", port], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("diffspec: error: cannot listen on 127.0.0.1:")


# --- the real default target (CI) ---------------------------------------------------------------
@pytest.mark.slow
def test_real_model_chat_matches_generate():
    import diffspec
    from diffspec.api import load_engine

    prompt = "What is the capital of France?"
    expected = diffspec.generate(prompt, max_new_tokens=16)
    engine = load_engine()  # the default drafter and policy
    with ServerThread(engine, ServerConfig(engine.target.name)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        out = c.chat.completions.create(model=engine.target.name, messages=chat(prompt), max_tokens=16, temperature=0)
    assert out.choices[0].message.content == expected.text
    assert out.usage.completion_tokens == len(expected.token_ids)


def test_sampling_settings_reach_the_engine(client, reference):
    """temperature, top_p, top_k and seed of a request are the engine's own: a seeded sampled request gives exactly
    `generate` with the same SamplingParams, top_k = 1 gives the greedy text, and the seed is used (another seed, over
    a few, gives another text)."""
    prompt = "w9 w4 w9 w4"

    def ask(**kw):
        out = client.chat.completions.create(model="tiny", messages=chat(prompt), max_tokens=24, **kw)
        return out.choices[0].message.content

    settings = dict(temperature=1.3, top_p=0.9, top_k=6, seed=3)
    want = reference.generate(prompt, max_new_tokens=24, sampling=SamplingParams(**settings))
    assert ask(**{k: v for k, v in settings.items() if k != "top_k"}, extra_body={"top_k": 6}) == want.text
    greedy = reference.generate(prompt, max_new_tokens=24, sampling=GREEDY).text
    assert want.text != greedy  # the case can tell sampling from greedy decoding
    assert ask(temperature=1.3, seed=3, extra_body={"top_k": 1}) == greedy
    others = {ask(temperature=1.3, top_p=0.9, seed=s, extra_body={"top_k": 6}) for s in (4, 5, 6)}
    assert others - {want.text}
