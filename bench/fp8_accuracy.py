"""Weight formats for a BF16 model against BF16 itself, on the real SmolLM2 upcast (issue 39, deliverable 4's accuracy
figure; CPU, HF transformers as the forward).

    .venv/bin/python bench/fp8_accuracy.py [--prompts 20] [--tokens 48] [--formats fp8-row,fp8-b32,q8_0]

SmolLM2-135M-Instruct's GGUF (Q4_1, Q8_0 embedding) is read by transformers and upcast; the reference is every matrix
(attention, MLP, the tied head) rounded to BF16 — what a BF16 checkpoint of this model holds. Each format then stores
those BF16 matrices its way and is read back to fp32 (the forward stays fp32: the error is the weights' alone):

- fp8-row: E4M3 with one fp32 scale a row (amax / 448), the common FP8 serving layout (vLLM's `--quantization fp8`);
- fp8-b32: E4M3 with one scale per 32 weights of a row (amax / 448);
- q8_0: llama.cpp's Q8_0 (int8, one scale per 32: amax / 127, round to nearest) — what imp's GPU and CPU kernels
  already run.

For 20 chat prompts: the BF16 model's greedy answer (`--tokens`), then for each format, teacher-forced on that answer:
the share of positions whose argmax is BF16's token (greedy agreement), the logits' error (RMS of the difference over
the RMS of BF16's logits, and the largest absolute difference), KL(BF16 || format) in nats a token; and free-running
greedy: answers identical to BF16's, and the mean position of the first different token. Prints one table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "What is the capital of France, and why is it famous?",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for writing clear emails.",
    "Translate 'good morning, how are you?' into Spanish.",
    "Write a haiku about autumn leaves.",
    "What does the `git rebase` command do?",
    "List the planets of the solar system in order.",
    "How do I make a cup of green tea?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Write a SQL query that counts the rows of a table named users.",
    "Why is the sky blue?",
    "Give a JSON object describing a book with title, author and year.",
    "What is the difference between a list and a tuple in Python?",
    "Suggest a name for a coffee shop near the sea.",
    "How many minutes are there in a day? Show the arithmetic.",
    "Write a short story opening about a lighthouse keeper.",
    "Explain recursion to a ten-year-old.",
    "What are the benefits of regular exercise?",
    "Write a bash one-liner that counts the lines of every .py file in a folder.",
]


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to float8 E4M3 (finite: |x| <= 448 here, the scales see to it) and back."""
    return x.to(torch.float8_e4m3fn).to(torch.float32)


def fmt_weight(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """A BF16 matrix [rows, cols] stored as `fmt`, read back to fp32."""
    w = w.float()
    if fmt == "bf16":
        return w
    if fmt == "fp8-row":
        s = (w.abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-30)
        return e4m3(w / s) * s
    rows, cols = w.shape
    b = w.reshape(rows, cols // 32, 32)
    amax = b.abs().amax(dim=2, keepdim=True)
    if fmt == "fp8-b32":
        s = (amax / 448.0).clamp_min(1e-30)
        return (e4m3(b / s) * s).reshape(rows, cols)
    if fmt == "q8_0":  # ggml's quantize_row_q8_0_ref: d = amax / 127 stored as fp16, q = round(x / d)
        d = (amax / 127.0).half().float()
        q = torch.where(d > 0, torch.round(b / torch.where(d > 0, d, torch.ones_like(d))), torch.zeros_like(b))
        return (q.clamp(-127, 127) * d).reshape(rows, cols)
    raise ValueError(fmt)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--formats", default="fp8-row,fp8-b32,q8_0")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from imp.fetch import resolve_model
    from tests.hf_gguf import one_read

    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    path = resolve_model("smollm2-135m", progress=False)
    t0 = time.time()
    with one_read():
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32)
    model.eval()
    mats = {n: p for n, p in model.named_parameters() if p.dim() == 2}  # every linear and the (tied) embedding
    bf16 = {n: p.detach().to(torch.bfloat16).clone() for n, p in mats.items()}
    print(f"{path.name}: {len(mats)} matrices, {sum(p.numel() for p in mats.values()) / 1e6:.1f} M weights, "
          f"loaded in {time.time() - t0:.1f} s; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)

    def use(fmt: str) -> None:
        with torch.no_grad():
            for n, p in mats.items():
                p.copy_(fmt_weight(bf16[n], fmt))

    prompts = []
    for text in PROMPTS[: a.prompts]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_tensors="pt")
        prompts.append(ids if isinstance(ids, torch.Tensor) else ids["input_ids"])

    def greedy(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=a.tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        return out[0, ids.shape[1]:]

    def forced(ids: torch.Tensor, ans: torch.Tensor) -> torch.Tensor:
        """Logits [len(ans), V] predicting each answer token, teacher-forced."""
        full = torch.cat([ids[0], ans]).unsqueeze(0)
        with torch.no_grad():
            lg = model(full).logits[0]
        return lg[ids.shape[1] - 1: ids.shape[1] - 1 + len(ans)].float()

    use("bf16")
    t0 = time.time()
    ref_ans = [greedy(p) for p in prompts]
    ref_lg = [forced(p, r) for p, r in zip(prompts, ref_ans)]
    print(f"BF16 answers: {sum(len(r) for r in ref_ans)} tokens in {time.time() - t0:.1f} s", flush=True)
    rows = []
    for fmt in a.formats.split(","):
        use(fmt)
        agree = n = 0
        rel, mx, kl = [], [], []
        same, first = 0, []
        for p, r, rl in zip(prompts, ref_ans, ref_lg):
            lg = forced(p, r)
            agree += int((lg.argmax(-1) == r).sum())
            n += len(r)
            rel.append(float((lg - rl).pow(2).mean().sqrt() / rl.pow(2).mean().sqrt()))
            mx.append(float((lg - rl).abs().max()))
            lp, lq = torch.log_softmax(rl, -1), torch.log_softmax(lg, -1)
            kl.append(float((lp.exp() * (lp - lq)).sum(-1).mean()))
            g = greedy(p)
            m = min(len(g), len(r))
            diff = (g[:m] != r[:m]).nonzero()
            if len(g) == len(r) and not len(diff):
                same += 1
                first.append(len(r))
            else:
                first.append(int(diff[0]) if len(diff) else m)
        rows.append((fmt, agree / n, statistics.mean(rel), max(mx), statistics.mean(kl), same, statistics.mean(first)))
        print(f"{fmt}: done", flush=True)
    print()
    print(f"| format | greedy agreement (teacher-forced, {n} tokens) | logits RMS error / RMS | max abs logit error | "
          f"KL nats / token | answers identical (of {len(prompts)}) | first different token (mean position) |")
    print("|---|---|---|---|---|---|---|")
    for fmt, ag, rl, mx_, kl_, sm, fd in rows:
        print(f"| {fmt} | {100 * ag:.1f} % | {rl:.4f} | {mx_:.2f} | {kl_:.5f} | {sm} | {fd:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
