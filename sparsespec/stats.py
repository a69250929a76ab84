"""Per-request counters and clocks (raw counts and seconds; ratios are derived when read)."""
from __future__ import annotations

import resource
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch


class Clock:
    """Wall clock that synchronises the device before reading (CUDA work is asynchronous)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


@dataclass
class RunStats:
    method: str
    k: int | str
    num_prompt_tokens: int
    num_steps: int = 0
    num_emitted: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_draft_forwards: int = 0
    accept_hist: Counter = field(default_factory=Counter)  # (k, accepted) -> steps
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    controller_s: float = 0.0
    draft_entropies: list[float] = field(default_factory=list)
    draft_labels: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    budget_tokens_sum: int = 0
    context_tokens_sum: int = 0
    kv_bytes: int = 0
    emit_times: list[float] = field(default_factory=list)

    def to_dict(self, num_output_tokens: int, device: torch.device) -> dict:
        from sparsespec.adaptive import roc_auc

        decode_s = max(0.0, self.total_s - self.ttft_s)
        gaps = np.diff(np.asarray(self.emit_times)) if len(self.emit_times) > 1 else np.zeros(0)
        pct = (lambda q: float(np.percentile(gaps, q))) if gaps.size else (lambda q: None)
        if device.type == "cuda":
            peak = int(torch.cuda.max_memory_allocated(device))
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # process peak RSS
        drafting_steps = sum(self.accept_hist.values())
        mean_draft = self.draft_s / self.num_draft_forwards if self.num_draft_forwards else None
        mean_verify = self.verify_s / self.num_steps if self.num_steps else None
        return {
            "method": self.method,
            "k": self.k,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": num_output_tokens,
            "num_steps": self.num_steps,
            "num_emitted": self.num_emitted,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "num_draft_forwards": self.num_draft_forwards,
            "accept_hist": {f"{k}:{a}": n for (k, a), n in sorted(self.accept_hist.items())},
            "prefill_s": self.prefill_s,
            "ttft_s": self.ttft_s,
            "decode_s": decode_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "other_s": max(0.0, decode_s - self.draft_s - self.verify_s),
            "total_s": self.total_s,
            "controller_s": self.controller_s,
            "num_entropy_labels": len(self.draft_labels),
            # how well low draft entropy predicts acceptance (None until both outcomes were seen)
            "entropy_auc": roc_auc([-h for h in self.draft_entropies], self.draft_labels)
            if self.draft_labels else None,
            "itl_p50_s": pct(50),
            "itl_p95_s": pct(95),
            "itl_p99_s": pct(99),
            "budget_tokens_sum": self.budget_tokens_sum,
            "context_tokens_sum": self.context_tokens_sum,
            "budget_frac": (self.budget_tokens_sum / self.context_tokens_sum) if self.context_tokens_sum else None,
            "kv_bytes": self.kv_bytes,
            # convenience ratios for this one request (reports recompute them pooled from the raw keys)
            "alpha": self.num_accepted / self.num_drafted if self.num_drafted else None,
            "tau": self.num_emitted / self.num_steps if self.num_steps else None,
            "mean_k": self.num_drafted / drafting_steps if drafting_steps else None,
            "gamma": mean_draft / mean_verify if mean_draft is not None and mean_verify else None,
            "tokens_per_s": num_output_tokens / self.total_s if self.total_s > 0 else None,
            "tpot_s": decode_s / (num_output_tokens - 1) if num_output_tokens > 1 else None,
            "peak_mem_bytes": peak,
        }
