"""Train an EAGLE-3 head for a target on this machine by self-distillation (no download).

    python -m sparsespec.train_eagle3 --model smollm2-135m            # about 25 minutes on 2 cores
    python -m sparsespec.train_eagle3 --model smollm2-135m --minutes 5 --out /tmp/head

Data, all shipped and license-clean: windows of the public-domain books
(``../shared/data/public_domain_books``, one book held out) and chat conversations made here:
prompts written from templates over book passages (summarise, continue, answer, list), answered
by the target itself (greedy, so the head learns the distribution it will draft for), formatted
with the model's chat template. Every token stream is packed into windows of ``--seq-len``.

Teacher: the target's own next-token distribution at every position (restricted to the draft
vocabulary and renormalised) and its hidden states at the three feature layers; the head is
trained with EAGLE-3's training-time test: ``--ttt-steps`` unrolled draft steps, step ``j``
reading the head's own output hidden from step ``j-1`` and attending to the target-feature pairs
before it plus its own earlier steps' pairs at the same position (exactly what drafting sees),
soft cross-entropy weighted ``0.8**j``. The draft vocabulary is the ``--draft-vocab`` ids the
target predicts most often on the training windows (EOS ids always in). The LM head starts from
the target's rows of those ids and stays frozen; ``fc`` starts by picking the high feature.

At the end: top-1 agreement per draft step on held-out windows, and the acceptance measured by
the engine (``eagle3`` vs the target's greedy output) on held-out chat prompts; both are saved
with the head (``config.json`` -> ``sparsespec``) in the EAGLE-3 format ``sparsespec.eagle3_head``
reads, under ``$SPARSESPEC_CACHE/eagle3/<model>`` by default.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from sparsespec.eagle3_head import Eagle3Config, Eagle3Head
from sparsespec.kv.cache import KVCache
from sparsespec.model import Transformer

HELD_OUT_BOOK = "145-0.txt"  # Middlemarch: never trained on
PROMPT_TEMPLATES = (
    "Summarise the following passage in a few sentences.\n\n{p}",
    "Continue this story for another paragraph.\n\n{p}",
    "Who are the characters in this passage, and what do they want?\n\n{p}",
    "Rewrite this passage in plain modern English.\n\n{p}",
    "List three questions a reader might ask about this passage, then answer them.\n\n{p}",
    "{p}\n\nWhat happens next? Explain briefly.",
)


@dataclass(frozen=True)
class TrainConfig:
    """Training knobs (validated). ``steps``: optimiser steps; ``minutes``: wall-clock cap of the
    optimisation phase (the cosine schedule follows whichever of the two ends first, so a capped
    run still anneals; it then depends on the machine's speed)."""

    seq_len: int = 256
    batch_size: int = 8
    steps: int = 400
    minutes: float = 15.0
    lr: float = 1e-3
    warmup: int = 20
    ttt_steps: int = 3
    draft_vocab: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "steps", "ttt_steps", "draft_vocab"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.seq_len < self.ttt_steps + 2:
            raise ValueError(f"seq_len must be at least ttt_steps + 2 = {self.ttt_steps + 2}")
        if not self.lr > 0 or not self.minutes > 0:
            raise ValueError("lr and minutes must be positive")


# ---------------------------------------------------------------------- data
def pack(streams: Sequence[Sequence[int]], seq_len: int) -> torch.Tensor:
    """Concatenate token streams and cut ``[N, seq_len]`` windows (the tail is dropped)."""
    flat = [t for s in streams for t in s]
    n = len(flat) // seq_len
    if n == 0:
        raise ValueError(f"need at least {seq_len} tokens, got {len(flat)}")
    return torch.tensor(flat[: n * seq_len], dtype=torch.long).view(n, seq_len)


@torch.inference_mode()
def teacher_pass(model: Transformer, windows: torch.Tensor, aux_layers: Sequence[int], batch_size: int = 8,
                 progress: bool = False, store_dtype: torch.dtype = torch.float32):
    """The target over ``windows`` ``[N, T]``: features ``[N, T, 3 E]`` of ``aux_layers``, the
    final hidden state ``[N, T, E]`` (after the final norm), both stored in ``store_dtype``
    (``torch.bfloat16`` halves the 9.2 KB per token of SmolLM2's fp32 teacher, so three times the
    data fits in memory; ``ttt_loss`` computes in fp32 either way), and the greedy next token
    ``[N, T]`` (from the fp32 logits)."""
    if store_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"store_dtype must be torch.float32 or torch.bfloat16, got {store_dtype}")
    from tqdm.auto import tqdm

    N, T = windows.shape
    L = model.cfg.num_layers
    layers = tuple(aux_layers) + (L - 1,)
    feats, finals, argmax = [], [], []
    for s in tqdm(range(0, N, batch_size), desc="teacher pass", disable=not progress, unit="batch"):
        ids = windows[s : s + batch_size].to(model.device)
        cache = KVCache(model.cfg, ids.shape[0], T, model.dtype, model.device)
        logits, _, f = model.forward_dense_features(ids, cache, layers)
        E = model.cfg.hidden_size
        feats.append(f[..., : 3 * E].float().to(store_dtype).cpu())
        finals.append(model._rms(f[..., 3 * E :], model.norm).float().to(store_dtype).cpu())
        argmax.append(logits.argmax(-1).cpu())
    return torch.cat(feats), torch.cat(finals), torch.cat(argmax)


def choose_draft_vocab(argmax: torch.Tensor, size: int, vocab_size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The ``size`` target ids predicted most often (``argmax`` counts; ties by id), ``always``
    included; sorted ascending ``[size]`` int64."""
    counts = torch.bincount(argmax.flatten(), minlength=vocab_size).double()
    counts[torch.tensor(list(always), dtype=torch.long)] = float("inf") if always else 0
    counts += torch.linspace(1e-6, 0, vocab_size, dtype=torch.double)  # ties: lower id first
    return counts.topk(min(size, vocab_size)).indices.sort().values


def init_head(model: Transformer, draft_ids: torch.Tensor, seed: int = 0) -> Eagle3Head:
    """A fresh head for ``model``: LM head = the target's rows of ``draft_ids``, final norm = the
    target's, ``fc`` picks the high feature, the layer's weights small random (std 0.02, its
    output projections zero, so the head starts as the residual path)."""
    cfg = Eagle3Config.for_target(model.cfg, draft_vocab_size=int(draft_ids.numel()))
    head = Eagle3Head(cfg, embed=model.embed, dtype=torch.float32, device=model.device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    E = cfg.hidden_size
    with torch.no_grad():
        head.fc.zero_()
        head.fc[:, 2 * E : 3 * E] = torch.eye(E)
        head.wqkv.copy_(torch.randn(head.wqkv.shape, generator=g) * 0.02)
        head.w_gate_up.copy_(torch.randn(head.w_gate_up.shape, generator=g) * 0.02)
        head.wo.zero_()
        head.w_down.zero_()
        head.norm.copy_(model.norm.float())
        lm = model.lm_head.dequantize() if hasattr(model.lm_head, "dequantize") else model.lm_head  # an int8 target
        head.lm_head.copy_(lm.float()[draft_ids])
    head.set_vocab(draft_ids)
    head.lm_head.requires_grad_(False)
    return head


# ---------------------------------------------------------------------- training-time test
def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def ttt_forward(head: Eagle3Head, feats: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Unrolled draft steps over windows: ``feats`` ``[B, T, 3 E_t]``, ``ids`` ``[B, T]``.

    Query ``t`` of step ``j`` (``t`` in ``[0, T-1)``) reads token ``x_{t+j+1}`` and, for ``j > 0``,
    the step ``j-1`` output at ``t``; it sits at position ``t + j`` and attends to step 0's pairs
    ``<= t`` (target features) and to steps ``1..j``'s pairs at ``t`` (its own chain), which is
    what drafting ``j`` tokens after the pair ``t`` sees. Returns per step the draft logits
    ``[B, T-1, V_d]`` predicting ``x_{t+j+2}``.
    """
    B, T = ids.shape
    Tq = T - 1
    c = head.cfg
    G = c.num_heads // c.num_kv_heads
    dev = ids.device
    t = torch.arange(Tq, device=dev)
    causal = t[None, :] <= t[:, None]  # [Tq, Tq] key <= query
    hidden = head.fuse(feats[:, :Tq])  # [B, Tq, E]
    k0 = v0 = None
    diag_k, diag_v, out = [], [], []
    for j in range(steps):
        tok = ids[:, (t + j + 1).clamp(max=T - 1)]  # [B, Tq]
        pos = (t + j)[None].expand(B, Tq)
        q, k, v, residual = head.qkv(tok, hidden, pos)  # q [B, H, Tq, D]
        k, v = _repeat_kv(k, G), _repeat_kv(v, G)
        if j == 0:
            k0, v0 = k, v
        else:
            diag_k.append(k)
            diag_v.append(v)
        s0 = (q @ k0.transpose(-1, -2)) * head.scale  # [B, H, Tq, Tq]
        s0 = s0.masked_fill(~causal, float("-inf"))
        if diag_k:
            sd = torch.stack([(q * dk).sum(-1) for dk in diag_k], dim=-1) * head.scale  # [B, H, Tq, j]
            p = torch.softmax(torch.cat([s0, sd], dim=-1), dim=-1)
            a = p[..., :Tq] @ v0 + sum(p[..., Tq + i, None] * dv for i, dv in enumerate(diag_v))
        else:
            a = torch.softmax(s0, dim=-1) @ v0
        hidden = head.finish(a, residual)
        out.append(head.draft_logits(hidden))
    return out


def ttt_loss(head: Eagle3Head, feats, finals, ids, steps: int, target_lm_head: torch.Tensor, decay: float = 0.8):
    """Soft cross-entropy of each unrolled step against the target's distribution (restricted to
    the draft vocabulary), weighted ``decay**j``; returns (loss, per-step top-1 agreement [steps],
    per-step valid counts [steps])."""
    B, T = ids.shape
    Tq = T - 1
    feats, finals = feats.float(), finals.float()  # a bf16 teacher (``teacher_pass``'s store_dtype) in fp32
    logits = ttt_forward(head, feats, ids, steps)
    with torch.no_grad():
        teacher = F.linear(finals, target_lm_head).float()  # [B, T, V_d]
        t_full_argmax = teacher.argmax(-1)
    loss = 0.0
    agree, counts = [], []
    t = torch.arange(Tq, device=ids.device)
    for j, lg in enumerate(logits):
        src = t + j + 1  # the teacher position whose distribution step j predicts
        valid = src < T
        n = int(valid.sum())
        tp = torch.softmax(teacher[:, src.clamp(max=T - 1)], dim=-1)  # [B, Tq, V_d]
        ce = -(tp * torch.log_softmax(lg, dim=-1)).sum(-1)  # [B, Tq]
        loss = loss + (decay ** j) * ce[:, valid].mean()
        with torch.no_grad():
            agree.append(float((lg.argmax(-1) == t_full_argmax[:, src.clamp(max=T - 1)])[:, valid].float().mean()))
        counts.append(n * B)
    return loss, agree, counts


def train(head: Eagle3Head, feats: torch.Tensor, finals: torch.Tensor, ids: torch.Tensor, cfg: TrainConfig,
          progress: bool = False, log=print) -> dict:
    """AdamW over the head's trainable parameters on windows (``teacher_pass`` outputs), cosine
    schedule with warmup; stops at ``cfg.steps`` or ``cfg.minutes``. Returns a summary dict."""
    from tqdm.auto import tqdm

    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    t0 = time.perf_counter()

    def progress_at(s: int) -> float:
        # the cosine follows whichever ends first, the steps or the time cap, so a capped run
        # still anneals to zero instead of stopping at a high learning rate
        return min(1.0, max(s / cfg.steps, (time.perf_counter() - t0) / (60 * cfg.minutes)))

    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * progress_at(s))))
    rng = random.Random(cfg.seed)
    N = ids.shape[0]
    order: list[int] = []
    bar = tqdm(range(cfg.steps), desc="train eagle3", disable=not progress, unit="step")
    loss_ema = None
    done = 0
    for step in bar:
        if not order:
            order = list(range(N))
            rng.shuffle(order)
        idx = torch.tensor([order.pop() for _ in range(min(cfg.batch_size, len(order)))])
        loss, agree, _ = ttt_loss(head, feats[idx], finals[idx], ids[idx], cfg.ttt_steps, head.lm_head)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        done = step + 1
        loss_ema = float(loss.detach()) if loss_ema is None else 0.95 * loss_ema + 0.05 * float(loss.detach())
        bar.set_postfix(loss=f"{loss_ema:.3f}", top1=" ".join(f"{a:.2f}" for a in agree))
        if (time.perf_counter() - t0) / 60 > cfg.minutes:
            log(f"time cap of {cfg.minutes} min reached after {done} steps")
            break
    bar.close()
    return {"steps": done, "train_seconds": round(time.perf_counter() - t0, 1), "final_loss_ema": loss_ema}


@torch.no_grad()
def held_out_agreement(head: Eagle3Head, feats, finals, ids, steps: int, batch_size: int = 8) -> list[float]:
    """Per unrolled step, the share of held-out positions where the head's argmax is the target's."""
    sums = [0.0] * steps
    ns = [0] * steps
    for s in range(0, ids.shape[0], batch_size):
        _, agree, counts = ttt_loss(head, feats[s : s + batch_size], finals[s : s + batch_size],
                                    ids[s : s + batch_size], steps, head.lm_head)
        for j in range(steps):
            sums[j] += agree[j] * counts[j]
            ns[j] += counts[j]
    return [round(a / max(n, 1), 4) for a, n in zip(sums, ns)]


# ---------------------------------------------------------------------- the real-model pipeline
def book_texts(held_out: bool = False) -> list[tuple[str, str]]:
    """(name, text) of the shipped public-domain books (the held-out one alone if ``held_out``)."""
    # the shared offline data ($SPARSESPEC_DATA_DIR, else ../shared/data beside the checkout);
    # the engine does not import the benchmarks package (evals.common resolves it the same way)
    root = os.environ.get("SPARSESPEC_DATA_DIR") or Path(__file__).resolve().parents[2] / "shared" / "data"
    folder = Path(root) / "public_domain_books"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise ValueError(f"no books in {folder}")
    pick = [f for f in files if (f.name == HELD_OUT_BOOK) == held_out]
    return [(f.name, f.read_text(encoding="utf-8-sig", errors="replace")) for f in pick]


def _strip_gutenberg(text: str) -> str:
    start = text.find("*** START OF")
    end = text.find("*** END OF")
    if start >= 0:
        text = text[text.find("\n", start) + 1 :]
    if end > 0:
        text = text[: text.find("*** END OF")]
    return text


@functools.lru_cache(maxsize=16)
def _token_ids(tokenizer, text: str) -> tuple[int, ...]:
    """``text``'s token ids (no special tokens). Remembered: a run reads each book for its chat
    prompts and again for its windows, and tokenising the six books takes seconds."""
    return tuple(tokenizer(text, add_special_tokens=False).input_ids)


def chat_prompts(tokenizer, texts: Sequence[str], n: int, seed: int, passage_tokens: int = 160) -> list[list[int]]:
    """``n`` chat prompts (token ids, generation prompt added): a template over a passage of a book."""
    rng = random.Random(seed)
    out = []
    tokenised = [_token_ids(tokenizer, _strip_gutenberg(t)) for t in texts]
    for i in range(n):
        ids = tokenised[i % len(tokenised)]
        s = rng.randrange(0, max(1, len(ids) - passage_tokens))
        passage = tokenizer.decode(list(ids[s : s + passage_tokens])).strip()
        user = PROMPT_TEMPLATES[rng.randrange(len(PROMPT_TEMPLATES))].format(p=passage)
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                             tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False).input_ids)
    return out


def _counts(acc: dict) -> dict:
    """The counts behind a ``chat_acceptance`` result (its alpha and tau are stored on their own)."""
    return {k: acc[k] for k in ("drafted", "accepted", "rounds")}


def chat_acceptance(engine, head_folder: Path, prompts: Sequence[Sequence[int]], k: int = 4,
                    max_new_tokens: int = 64) -> dict:
    """Greedy ``eagle3`` at fixed ``k`` with the head in ``head_folder`` over ``prompts`` (token
    ids), ``max_new_tokens`` each, EOS ignored: ``{"alpha", "tau", "drafted", "accepted", "rounds"}``
    (alpha = accepted / drafted; tau = tokens committed per drafting verify step)."""
    outs = engine.generate([list(p) for p in prompts], method="eagle3",
                           method_options={"draft_model": str(head_folder), "k": k},
                           max_new_tokens=max_new_tokens, ignore_eos=True)
    drafted = sum(o.stats["num_drafted"] for o in outs)
    accepted = sum(o.stats["num_accepted"] for o in outs)
    steps = sum(o.stats["num_drafting_steps"] for o in outs)
    return {"alpha": round(accepted / drafted, 4) if drafted else 0.0,
            "tau": round((accepted + steps) / steps, 3) if steps else 0.0,
            "drafted": drafted, "accepted": accepted, "rounds": steps}


def export_head(src: str | Path, dst: str | Path, target_folder: str | Path, dtype=torch.bfloat16) -> dict:
    """Write the head in ``src`` to ``dst`` for shipping: its floating tensors in ``dtype`` (the
    token maps unchanged), its ``config.json`` (its ``sparsespec`` meta without this machine's paths) and a
    ``manifest.json`` recording the weights' size and sha256 and the target it was trained on
    (the preset and GGUF sha256 from ``target_folder``'s ``sparsespec_provenance.json``), which
    ``sparsespec.drafters.eagle3.verify_shipped`` checks at load. Returns the manifest.

    Raises:
        ValueError: ``src`` is not a head folder, or the target folder has no provisioning record.
    """
    from safetensors.torch import load_file, save_file

    from sparsespec.eagle3_head import WEIGHTS_FILE
    from sparsespec.provision import sha256_file

    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file() or not (src / WEIGHTS_FILE).is_file():
        raise ValueError(f"{src}: not an EAGLE-3 head folder (config.json and {WEIGHTS_FILE} expected)")
    try:
        prov = json.loads((Path(target_folder) / "sparsespec_provenance.json").read_text())
        target = {"preset": prov["preset"], "hf_id": prov.get("hf_id"), "sha256": prov["sha256"]}
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{target_folder}: no provisioning record of the target ({type(e).__name__}: {e}); "
                         "only a provisioned preset's head can ship") from None
    tensors = {n: (t.to(dtype) if t.is_floating_point() else t) for n, t in load_file(str(src / WEIGHTS_FILE)).items()}
    cfg = json.loads((src / "config.json").read_text())
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    meta = dict(cfg.get("sparsespec", {}))
    if isinstance(meta.get("train"), dict):  # this machine's output folder means nothing where the head ships
        meta["train"] = {k: v for k, v in meta["train"].items() if k != "out"}
    cfg["sparsespec"] = meta | {"exported_dtype": cfg["torch_dtype"]}
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / WEIGHTS_FILE), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    manifest = {"weights_file": WEIGHTS_FILE, "weights_bytes": (dst / WEIGHTS_FILE).stat().st_size,
                "weights_sha256": sha256_file(dst / WEIGHTS_FILE), "dtype": cfg["torch_dtype"], "target": target}
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsespec.train_eagle3", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="preset or local folder of the target")
    ap.add_argument("--out", default=None, help="head folder (default $SPARSESPEC_CACHE/eagle3/<model>)")
    ap.add_argument("--book-tokens", type=int, default=120_000, help="tokens of book windows to train on")
    ap.add_argument("--chats", type=int, default=48, help="chat conversations generated by the target")
    ap.add_argument("--chat-tokens", type=int, default=128, help="tokens the target answers each chat with")
    ap.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    ap.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--minutes", type=float, default=TrainConfig.minutes, help="cap of the optimisation phase")
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--ttt-steps", type=int, default=TrainConfig.ttt_steps)
    ap.add_argument("--draft-vocab", type=int, default=TrainConfig.draft_vocab)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--feature-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="how the teacher's features and final hidden states are held in memory for training "
                         "(bfloat16: half the memory, for larger --chats / --book-tokens)")
    ap.add_argument("--export", default=None, metavar="HEAD",
                    help="no training: write the trained head folder HEAD to --out in bf16 with a manifest "
                         "(size, sha256, target) for shipping, then measure the exported head")
    ap.add_argument("--eval-chats", type=int, default=6, help="held-out chat prompts the acceptance is measured on")
    ap.add_argument("--eval-tokens", type=int, default=64,
                    help="tokens generated per held-out chat prompt for the acceptance")
    args = ap.parse_args(argv)
    try:
        cfg = TrainConfig(seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps, minutes=args.minutes,
                          lr=args.lr, ttt_steps=args.ttt_steps, draft_vocab=args.draft_vocab, seed=args.seed)
    except ValueError as e:
        ap.error(str(e))
    for name in ("book_tokens", "chats", "chat_tokens", "eval_chats", "eval_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.export and args.out is None:
        ap.error("--export needs --out (the shipped head's folder)")
    import os

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    torch.manual_seed(args.seed)
    from sparsespec import Engine
    from sparsespec.drafters.eagle3 import trained_head_dir

    from sparsespec.provision import ModelNotAvailableError

    t_start = time.perf_counter()
    try:
        engine = Engine.from_pretrained(args.model, dtype="float32")
    except (ValueError, ModelNotAvailableError) as e:
        print(f"error: cannot load the target {args.model!r}: {e}", file=sys.stderr)
        return 2
    model, tok = engine.model, engine.tokenizer
    name = Path(model.source_folder).name if model.source_folder else str(args.model)
    out = Path(args.out) if args.out else trained_head_dir(name)
    print(f"target {name}: {model.cfg.num_layers} layers, hidden {model.cfg.hidden_size}; head -> {out}")
    held_text = _strip_gutenberg(book_texts(held_out=True)[0][1])
    held_ids = list(_token_ids(tok, held_text))
    held = pack([held_ids[5000 : 5000 + 16 * cfg.seq_len]], cfg.seq_len)
    aux = Eagle3Config.for_target(model.cfg, 1).aux_layers
    eval_prompts = chat_prompts(tok, [held_text], args.eval_chats, args.seed + 1)

    if args.export:  # ship a trained head: bf16 + manifest, then the same held-out figures for it
        try:
            manifest = export_head(args.export, out, model.source_folder or "")
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        from sparsespec.drafters.eagle3 import load_head

        h_feats, h_finals, _ = teacher_pass(model, held, aux)
        agree = held_out_agreement(load_head(model, out), h_feats, h_finals, held, cfg.ttt_steps)
        acc = chat_acceptance(engine, out, eval_prompts, max_new_tokens=args.eval_tokens)
        figures = {"held_out_top1_per_step": agree, "held_out_alpha_k4": acc["alpha"], "held_out_tau_k4": acc["tau"],
                   "held_out_chats": args.eval_chats, "held_out_chat_tokens": args.eval_tokens,
                   "held_out_counts_k4": _counts(acc)}
        cfg_path = out / "config.json"  # the figures join the config; the weights and manifest stay as written
        config = json.loads(cfg_path.read_text())
        config["sparsespec"]["exported_figures"] = figures
        cfg_path.write_text(json.dumps(config, indent=2) + "\n")
        print(f"exported {args.export} -> {out}: {manifest['weights_bytes']} bytes, sha256 "
              f"{manifest['weights_sha256']}; held-out top-1 per step {agree}; {args.eval_chats} held-out chat "
              f"prompts, greedy, k=4: alpha {acc['alpha']:.3f}, tau {acc['tau']:.2f}")
        return 0

    # 1. chat conversations answered by the target (greedy) + book windows
    books = book_texts()
    texts = [_strip_gutenberg(t) for _, t in books]
    prompts = chat_prompts(tok, texts, args.chats, args.seed)
    chats = []
    from tqdm.auto import tqdm

    gen_batch = 32  # decode reads the weights once per step for the whole batch
    for s in tqdm(range(0, len(prompts), gen_batch), desc="chat answers", unit="batch"):
        outs = engine.generate(prompts[s : s + gen_batch], method="ar", max_new_tokens=args.chat_tokens)
        chats += [p + o.token_ids for p, o in zip(prompts[s : s + gen_batch], outs)]
    print(f"generated {len(chats)} chat answers ({sum(len(c) for c in chats)} tokens) "
          f"in {time.perf_counter() - t_start:.0f} s")
    per_book = args.book_tokens // max(1, len(texts))
    rng = random.Random(args.seed)
    streams = list(chats)
    for text in texts:
        ids = list(_token_ids(tok, text))
        s = rng.randrange(0, max(1, len(ids) - per_book))
        streams.append(ids[s : s + per_book])
    rng.shuffle(streams)
    windows = pack(streams, cfg.seq_len)

    # 2. teacher pass
    feats, finals, argmax = teacher_pass(model, windows, aux, progress=True,
                                         store_dtype=getattr(torch, args.feature_dtype))
    h_feats, h_finals, _ = teacher_pass(model, held, aux)
    draft_ids = choose_draft_vocab(argmax, cfg.draft_vocab, model.cfg.vocab_size, model.cfg.eos_token_ids)
    coverage = float(torch.isin(argmax, draft_ids).float().mean())
    print(f"{windows.shape[0]} windows x {cfg.seq_len} tokens; draft vocabulary {cfg.draft_vocab} ids cover "
          f"{coverage:.1%} of the target's greedy predictions")

    # 3. train
    head = init_head(model, draft_ids, cfg.seed)
    before = held_out_agreement(head, h_feats, h_finals, held, cfg.ttt_steps)
    summary = train(head, feats, finals, windows, cfg, progress=True)
    after = held_out_agreement(head, h_feats, h_finals, held, cfg.ttt_steps)
    print(f"held-out top-1 agreement per draft step: {after} (untrained head: {before})")
    meta = {"trained_by": "sparsespec.train_eagle3", "target": name, "train": vars(args) | {"model": str(args.model)},
            "windows": int(windows.shape[0]), "draft_vocab_coverage": round(coverage, 4),
            "held_out_book": HELD_OUT_BOOK, "held_out_top1_per_step": after, "untrained_top1_per_step": before,
            **summary}
    head.requires_grad_(False)
    head.save(out, meta)

    # 4. acceptance measured by the engine on held-out chat prompts (greedy, k = 4)
    acc = chat_acceptance(engine, out, eval_prompts, max_new_tokens=args.eval_tokens)
    meta |= {"held_out_alpha_k4": acc["alpha"], "held_out_tau_k4": acc["tau"], "held_out_chats": args.eval_chats,
             "held_out_chat_tokens": args.eval_tokens, "held_out_counts_k4": _counts(acc),
             "total_seconds": round(time.perf_counter() - t_start, 1)}
    head.save(out, meta)
    print(f"held-out chat prompts, greedy, k=4: alpha {acc['alpha']:.3f}, tau {acc['tau']:.2f} tokens per verify step")
    print(f"saved {out} ({meta['total_seconds']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
