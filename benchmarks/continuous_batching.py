"""Two requests join a running batch through ``EngineCore.step()``; their outputs are compared
with standalone greedy AR on the same prompts (the real offline model).

    .venv/bin/python benchmarks/continuous_batching.py [--method sparsespec-l] [--k auto]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparsespec import Engine, SamplingParams  # noqa: E402
from sparsespec.stats import derive  # noqa: E402

#: Alice in Wonderland (public domain), one of the shared offline books
BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "public_domain_books" / "11-0.txt"


def book_prompt(tokenizer, offset: int, num_tokens: int, question: str) -> list[int]:
    """A chat prompt: ``num_tokens`` tokens of the book from ``offset``, then ``question``."""
    ids = tokenizer(BOOK.read_text(encoding="utf-8-sig"), add_special_tokens=False).input_ids
    user = tokenizer.decode(ids[offset : offset + num_tokens]) + "\n\n" + question
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="sparsespec-l")
    ap.add_argument("--k", default="auto")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    a = ap.parse_args(argv)
    engine = Engine.from_pretrained(a.model)
    tok = engine.tokenizer
    prompts = {
        "first": book_prompt(tok, 2000, 1500, "Summarise what happened to Alice in the text above."),
        "joins-at-step-3": book_prompt(tok, 9000, 1200, "Repeat the first sentence of the text above."),
        "joins-at-step-6": book_prompt(tok, 5000, 900, "Who is speaking in the last paragraph?"),
    }
    joins = {"first": 0, "joins-at-step-3": 3, "joins-at-step-6": 6}
    k = a.k if a.k == "auto" else int(a.k)
    core = engine.core(a.method, {"k": k}, max_num_seqs=4)
    params = SamplingParams(max_new_tokens=a.max_new_tokens, ignore_eos=True)
    finals, step = {}, 0
    while len(finals) < len(prompts):
        for rid, at in joins.items():
            if at == step:
                core.add_request(rid, prompts[rid], params)
        for out in core.step():
            if out.finished:
                finals[out.request_id] = (step, out.output)
        print(f"step {step:3d}: running {[r.request_id for r in core.running]}")
        step += 1
    for rid, (done, out) in finals.items():
        ar = engine.generate([prompts[rid]], method="ar", max_new_tokens=a.max_new_tokens, ignore_eos=True)[0]
        d = derive(out.stats)
        print(f"{rid:16s} joined at step {joins[rid]}, finished at step {done}: "
              f"{len(out.token_ids)} tokens, identical to standalone AR: {out.token_ids == ar.token_ids}, "
              f"drafted {out.stats['num_drafted']}, alpha {d['alpha']:.3f}, tau {d['tau']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
