import time, torch
from diffspec.target import Target
from diffspec.training.store import decode_step_seconds, generate_batch
t = Target.load("smollm2-135m-instruct", quiet=True)
m = t.model
for turn in range(2):
    for b in (16, 64):
        for kind in ("model", "direct"):
            s = decode_step_seconds(m, b, 384, steps=3, decode_step=kind)
            print(turn, b, kind, f"{s*1000:.1f} ms/step {b/s:.1f} tok/s", flush=True)
tok = t.tokenizer
qs = ["Write a Python function that reverses a string.", "What is the capital of France?", "Explain recursion briefly.",
      "List three prime numbers.", "def fib(n):", "Give me a haiku about the sea.", "How do I sort a list in Python?", "Say hi."]
prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in qs]
prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
stops = set(t.stop_token_ids)
res = {}
for kind in ("model", "direct", "model", "direct"):
    t0 = time.perf_counter(); r = generate_batch(m, prompts, 96, stops, tok.pad_token_id or 0, decode_step=kind); dt = time.perf_counter() - t0
    print(kind, f"{sum(map(len, r))/dt:.1f} tok/s", sum(map(len, r)))
    res[kind] = r
print("same answers:", sum(a == b for a, b in zip(res["model"], res["direct"])), "of", len(prompts))
