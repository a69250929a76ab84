"""Targeted mutation testing of the engine: does each fault that would change an output or a
metric turn a fast test red?

mutmut over these modules would make thousands of mutants, and each needs the engine tests
(about two minutes here), so it does not fit this machine; this is the equivalent for the
faults that matter: a fixed list of hand-written mutants (each one a real fault: an output, a
distribution or a counter changes), applied one at a time to a copy of the tree, each run
against the fast tests with ``-x``. A mutant is *killed* when a test fails, *survives* when all
pass, and is *n/a* when its anchor text is not in this version of the code (so the same list
scores an older commit: ``--root``).

    .venv/bin/python benchmarks/mutation.py [--root DIR] [--only NAME,...] [--jobs 2] [--json-out F]

Run it by hand, alone on the machine (it is a measurement of the tests, not a test).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAST_TESTS = ["tests/test_engine_core.py", "tests/test_rejection.py", "tests/test_sampling.py",
              "tests/test_adaptive.py", "tests/test_engine_units.py", "tests/test_baselines.py",
              "tests/test_draft_model.py", "tests/test_engine_min_tokens.py", "tests/test_sampling_engine.py",
              "tests/test_kernels.py", "tests/test_perf_paths.py", "tests/test_cpu_kernels.py",
              "tests/test_engine_spec_tiny.py", "tests/test_draft_model_catch_up.py"]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    variants: tuple[tuple[str, str], ...]  # (original, replacement) per code version; first match applies
    what: str


def M(name, path, what, *variants):
    return Mutant(name, path, tuple(variants), what)


MUTANTS = [
    # ---- the importance window and the index (sparsespec-l)
    M("window_push_rejected", "sparsespec/drafters/sparse_self.py", "push every verified query, rejected ones too",
      ("self.window.push(rows, list(counts))", "self.window.push(rows, None)")),
    M("window_wiped_each_step", "sparsespec/drafters/sparse_self.py", "wipe the window before each push",
      ("        if rows is not None:\n            self.window.push(rows, list(counts))\n        for b",
       "        self.window.rows.zero_()\n        self.window.total.zero_()\n        if rows is not None:\n"
       "            self.window.push(rows, list(counts))\n        for b"),
      ("        if rows is not None:\n            self.window.push(rows, list(counts))",
       "        self.window.rows.zero_()\n        if rows is not None:\n            self.window.push(rows, list(counts))")),
    M("index_rebuild_skipped", "sparsespec/drafters/sparse_self.py", "never rebuild the index after a verify",
      ("                self._rebuild(cache, b)\n", "                pass\n"),
      ("        for b in range(cache.batch_size):\n            self._rebuild(cache, b)",
       "        pass")),
    M("window_scores_max", "sparsespec/kv/index.py", "score keys by the max over the window, not the sum",
      ("            tot -= self.rows[:, b, :, start : start + m, :wide].sum(dim=2)",
       "            tot -= 0 * self.rows[:, b, :, start : start + m, :wide].sum(dim=2)"),
      ("tot -= old.sum(dim=2)  #", "tot -= 0 * old.sum(dim=2)  #"),
      ("return rows[..., :length].sum(dim=3)", "return rows[..., :length].amax(dim=3)")),
    M("window_running_sum_double_add", "sparsespec/kv/index.py", "the running sum adds the new rows twice",
      ("            tot += self.rows[:, b, :, start : start + m, :wide].sum(dim=2)",
       "            tot += 2 * self.rows[:, b, :, start : start + m, :wide].sum(dim=2)"),
      ("tot[..., :S] += seg.sum(dim=2)", "tot[..., :S] += 2 * seg.sum(dim=2)")),
    # ---- the attention fast path (issue 15)
    M("tail_mask_strict", "sparsespec/model.py", "a query does not see its own key",
      ("mask = key_pos[None, None, m0:] <= positions[:, :, None]", "mask = key_pos[None, None, m0:] < positions[:, :, None]")),
    M("tail_mask_columns", "sparsespec/kernels/reference.py", "the tail mask applied to the first columns",
      ("tail = scores.view(B, Hkv, G, T, S)[..., mask_from:]", "tail = scores.view(B, Hkv, G, T, S)[..., : S - mask_from]")),
    M("rows_one_head_short", "sparsespec/kernels/reference.py", "importance rows miss a query head of the group",
      ("            for g in range(1, G):", "            for g in range(1, max(1, G - 1)):")),
    M("prepack_stale_weight", "sparsespec/quant.py", "the prepacked copy is not the weight",
      ("packed = w.detach().contiguous().to_mkldnn()", "packed = (w.detach() * 1.0001).contiguous().to_mkldnn()")),
    # ---- the cost controller (issue 15)
    M("cost_verify_width_ignored", "sparsespec/adaptive.py", "the verify costs the same whatever its width",
      ("        v = self.verify_cost.predict(B, k + 1, S)", "        v = self.verify_cost.predict(B, 1, S)")),
    M("cost_tokens_off_by_one", "sparsespec/adaptive.py", "expected tokens without the bonus token",
      ("return (1.0 - a ** (k + 1)) / (1.0 - a)", "return (1.0 - a ** k) / (1.0 - a)")),
    M("row_alpha_no_rejection_label", "sparsespec/adaptive.py", "the first rejection is not a label",
      ("labels = [1.0] * num_accepted + ([0.0] if num_accepted < m else [])", "labels = [1.0] * num_accepted")),
    M("cost_draft_not_charged", "sparsespec/adaptive.py", "draft forwards cost nothing",
      ("            d = k * self.draft_ratio * (d1 or 0.0)", "            d = 0.0")),
    M("explore_one_round", "sparsespec/adaptive.py", "a row stops exploring at its first label",
      ("any(p.num_labels < self.explore_labels for p in policies)", "any(p.num_labels == 0 for p in policies)")),
    M("cost_never_skips", "sparsespec/adaptive.py", "k = 0 is never chosen",
      ("        best_k, best_rate = 0, sum(1.0 for _ in alphas) / base", "        best_k, best_rate = 0, 0.0"),
      ("        best_k, best_rate = 0, float(rates[0])", "        best_k, best_rate = 0, 0.0")),
    M("costs_verify_width_ignored", "sparsespec/adaptive.py", "the per-step costs price every verify at width 1",
      ("verify = c0 + B * (k + 1) * (c1 + c2 * S) + c3 * B * S", "verify = c0 + B * (c1 + c2 * S) + c3 * B * S")),
    M("tokens_limit_off_by_one", "sparsespec/adaptive.py", "a row's expected tokens stop one draft short of its limit",
      ("                if k <= lim:\n", "                if k < lim:\n")),
    M("optimism_without_spread", "sparsespec/adaptive.py", "a row's optimistic alpha is its mean (no bound)",
      ("        return min(1.0, (a + z2 / (2.0 * n) + half) / (1.0 + z2 / n))", "        return a")),
    M("optimism_without_prior", "sparsespec/adaptive.py", "a row's optimistic alpha ignores the prior's pseudo-labels",
      ("            out.append(self._wilson_upper((n * float(p.alpha or 0.0) + m * base) / (n + m), n + m))",
       "            out.append(self._wilson_upper(float(p.alpha or 0.0), n) if n > 0 else 1.0)")),
    M("explore_full_size_unmeasured", "sparsespec/adaptive.py",
      "a cold core explores at explore_k before any draft is timed",
      ("            k = explore if self.draft_measured else min(explore, self.probe_k)", "            k = explore")),
    M("learned_prior_unshrunk", "sparsespec/adaptive.py", "a later core starts from the rows' raw alpha, however few labels",
      ("seen = ((self._alpha_sum + m * self.prior_alpha) / (self._alpha_n + m) if self._alpha_n",
       "seen = ((self._alpha_sum) / (self._alpha_n) if self._alpha_n")),
    M("decline_margin_ignored", "sparsespec/adaptive.py", "a drafting k that beats AR by any amount is taken",
      ("        if best_k and not best_rate > float(rates[0]) * (1.0 + self.margin):", "        if False:")),
    M("probe_ignores_finished_lengths", "sparsespec/adaptive.py", "a probe's horizon is the budget alone",
      ("                left = min(left, self.residual(generated[b]))", "                pass")),
    M("engine_hides_rows_output", "sparsespec/engine.py", "the controller is not told what each row has emitted",
      ("                                          [len(r.out) for r in rows])",
       "                                          None)")),
    M("learned_prior_pooled_by_labels", "sparsespec/adaptive.py",
      "a finished row votes with its labels' weight, not once",
      ("            self._alpha_n += 1.0\n",
       "            self._alpha_n += 1.0 * n\n            self._alpha_sum += (n - 1) * policy.alpha\n")),
    M("refit_ignores_drift", "sparsespec/adaptive.py", "the verify-cost fit waits for history rounds whatever they measure",
      ("or (self._new >= self.refit_every and abs(statistics.median(", "or (False and abs(statistics.median(")),
    M("probe_ignores_remaining", "sparsespec/adaptive.py", "a probe runs whatever the rows have left",
      ("            left = math.inf if remaining is None else remaining[b]", "            left = math.inf")),
    M("explore_when_hopeless", "sparsespec/adaptive.py", "exploring goes on where the rows' labels say it loses",
      ("                and not self.hopeless(policies, budgets, B, S, N, costs)):", "                ):")),
    M("index_top_offset", "sparsespec/kv/index.py", "top positions off by the sink count",
      ("top = torch.topk(middle, n_top, dim=-1, sorted=False).indices + n_sink",
       "top = torch.topk(middle, n_top, dim=-1, sorted=False).indices")),
    M("index_recent_shift", "sparsespec/kv/index.py", "recent window one position early",
      ("recent = torch.arange(length - n_recent, length, device=device)",
       "recent = torch.arange(length - n_recent - 1, length - 1, device=device)")),
    M("prefill_rows_last_chunk_only", "sparsespec/model.py", "importance rows only from the last prefill chunk",
      ("bounds = prefill_chunks(P, chunk_size, want)", "bounds = prefill_chunks(P, chunk_size, 0)")),
    M("snapkv_last_query_votes", "sparsespec/drafters/sparse_self.py", "SnapKV votes with the last query only",
      ("votes = rows[..., : length - w].sum(dim=3)", "votes = rows[..., -1, : length - w]")),
    M("streaming_window_shift", "sparsespec/drafters/sparse_self.py", "StreamingLLM window one position early",
      ("torch.arange(length - (budget - n_sink), length, device=device)",
       "torch.arange(length - (budget - n_sink) - 1, length - 1, device=device)")),
    M("ngram_oldest_match", "sparsespec/drafters/ngram.py", "continue the oldest match, not the most recent",
      ("start = int(hits[-1]) + n", "start = int(hits[0]) + n")),
    M("draft_model_no_rollback", "sparsespec/drafters/draft_model.py", "keep rejected drafts in the draft cache",
      ("0 if self.retired[b] else min(self.dcache.lengths[b], cache.lengths[b])",
       "0 if self.retired[b] else self.dcache.lengths[b]"),
      ("[0 if self.retired[b] else min(n, cache.lengths[b])", "[0 if self.retired[b] else n")),
    # ---- drafting, q and the verifier
    M("q_unprocessed", "sparsespec/drafters/base.py", "q = the raw softmax, not the processed distribution",
      ("            q = sampling.probs(logits)  # [B, V]", "            q = torch.softmax(logits.float(), -1)"),
      ("            q = logits_to_probs(logits, sp.temperature, sp.top_k, sp.top_p)  # [B, V]",
       "            q = torch.softmax(logits.float(), -1)")),
    M("q_reported_unprocessed", "sparsespec/drafters/base.py", "sample from processed q, verify with the raw one",
      ("            qs.append(q)\n", "            qs.append(torch.softmax(logits.float(), -1))\n")),
    M("entropy_wrong", "sparsespec/drafters/base.py", "entropy of the draft token miscomputed",
      ("ents.append(-(logp.exp() * logp).sum(-1))", "ents.append(-logp.sum(-1) / logp.shape[-1])")),
    M("accept_ignores_q", "sparsespec/rejection.py", "accept with p(x) > u instead of p(x) > u q(x)",
      ("accept = valid & (p_x.double() > u * q_x.double())", "accept = valid & (p_x.double() > u)")),
    M("recover_from_p", "sparsespec/rejection.py", "recover from p instead of norm(max(0, p - q))",
      ("residual = (p_last - q_last).clamp(min=0.0)", "residual = p_last")),
    M("bonus_residual_swap", "sparsespec/rejection.py", "bonus from the residual, recovery from p",
      ("weights = torch.where(rejected, residual, p_last)", "weights = torch.where(rejected, p_last, residual)")),
    M("greedy_not_leading_run", "sparsespec/rejection.py", "count every match, not the leading run",
      ("num_accepted = match.long().cumprod(dim=1).sum(dim=1)  # [B]",
       "num_accepted = match.long().sum(dim=1)  # [B]")),
    M("top_k_off_by_one", "sparsespec/sampling.py", "top-k keeps k+1 tokens",
      ("keep_sorted[..., top_k:] = False", "keep_sorted[..., top_k + 1 :] = False")),
    M("top_p_loose", "sparsespec/sampling.py", "nucleus boundary 5 % too wide",
      ("in_nucleus = mass_above < (top_p - _TOP_P_SLACK)", "in_nucleus = mass_above < (top_p + 0.05)")),
    # ---- the engine loop
    M("draft_clip_ignores_budget", "sparsespec/engine.py", "draft up to the remaining budget, not budget - 1",
      ("budgets = [r.params.max_new_tokens - len(r.out) - 1 for r in rows]",
       "budgets = [r.params.max_new_tokens - len(r.out) for r in rows]"),
      ("budgets = [sp.max_new_tokens - len(r.out) - 1 for r in active]",
       "budgets = [sp.max_new_tokens - len(r.out) for r in active]")),
    M("controller_no_costs", "sparsespec/engine.py", "the controller is never given measured costs",
      ("        self.costs.observe(st.draft_s / K if K else 0.0, st.verify_s, K + 1, other_s)\n", ""),
      ("                policy.observe_costs(draft_s / n_fwd, verify_s)", "                pass")),
    M("stop_accounting", "sparsespec/engine.py", "drafts after a stop inside a block still counted",
      ("n_counted = min(nd, kept) if stopped else nd", "n_counted = nd"),
      ("                    st.num_accepted += min(a, kept)", "                    st.num_accepted += a")),
    M("draft_time_every_row", "sparsespec/engine.py", "draft time charged to rows that drafted nothing",
      ("            s.verify_s += st.verify_s\n", "            s.verify_s += st.verify_s\n            s.draft_s += st.draft_s\n")),
    M("rollback_keeps_rejected", "sparsespec/engine.py", "the dense cache keeps one rejected draft",
      ("st.cache.rollback([base[b] + 1 + a for b, a in enumerate(st.accepted)])",
       "st.cache.rollback([min(base[b] + 2 + a, base[b] + 1 + len(st.draft.token_ids[b])) for b, a in enumerate(st.accepted)])"),
      ("cache.rollback([base[b] + 1 + a for b, a in enumerate(accepted)])",
       "cache.rollback([min(base[b] + 2 + a, base[b] + 1 + drafts.shape[1]) for b, a in enumerate(accepted)])")),
    M("min_tokens_off_by_one", "sparsespec/engine.py", "min_new_tokens masks one position too few",
      ("n = max(0, min(logits.shape[1], r.params.min_new_tokens - num_out[b]))",
       "n = max(0, min(logits.shape[1], r.params.min_new_tokens - num_out[b] - 1))"),
      ("masked = max(0, min(logits.shape[1], sp.min_new_tokens - n))",
       "masked = max(0, min(logits.shape[1], sp.min_new_tokens - n - 1))")),
    M("stream_no_holdback", "sparsespec/engine.py", "stream a split UTF-8 character's replacement glyph",
      ('target = req.text.rstrip("\\ufffd")', "target = req.text")),
    M("rows_share_a_seed", "sparsespec/engine.py", "every row of generate(seed=s) samples the same stream",
      ("    return int(np.random.SeedSequence([int(seed), i]).generate_state(1, dtype=np.uint64)[0])",
       "    return int(seed)")),
    M("move_drops_last_position", "sparsespec/kv/cache.py", "pool compaction drops a row's last position",
      ("        self.k[:, dst, :, :n] = self.k[:, src, :, :n]", "        self.k[:, dst, :, : n - 1] = self.k[:, src, :, : n - 1]")),
    # ---- the controller
    M("labels_include_rejected", "sparsespec/adaptive.py", "the first rejected token updates mu_accept",
      ("for h in list(entropies)[:num_accepted]:", "for h in list(entropies)[: num_accepted + 1]:")),
    M("expected_tokens_no_product", "sparsespec/adaptive.py", "E(k) without the running product",
      ("            run *= float(p)\n", "            run = float(p)\n")),
    M("accept_prob_sign", "sparsespec/adaptive.py", "high entropy predicts acceptance",
      ("return _sigmoid(2.0 * self.sharpness * (mid - h) / s)", "return _sigmoid(2.0 * self.sharpness * (h - mid) / s)")),
    # ---- the importance window's ring (the verify writes its rows into spare slots; issue 25)
    M("ring_commits_rejected", "sparsespec/drafters/sparse_self.py", "commit every verified query's ring slot, rejected too",
      ("                self.window.commit_row(b, n, width)",
       "                self.window.commit_row(b, self._target[0].slots.shape[1], width)")),
    M("ring_target_overwrites_newest", "sparsespec/kv/index.py", "a verify writes over the newest committed row",
      ("slots = torch.tensor([[(self._next[b] + t) % self.slots", "slots = torch.tensor([[(self._next[b] - 1 + t) % self.slots")),
    M("ring_evicts_one_short", "sparsespec/kv/index.py", "the oldest row is not subtracted when it leaves the window",
      ("        n = max(0, held + incoming - self.window)", "        n = max(0, held + incoming - self.window - 1)")),
    # ---- our CPU kernels (sparsespec/kernels/cpu/sparsespec_cpu.c: rebuilt per mutant)
    M("kernel_causal_off_by_one", "sparsespec/kernels/cpu/sparsespec_cpu.c", "a verify query sees the next draft's key",
      ("                    if (j + u > lim) S[rr * ld + j + u] = -INFINITY;",
       "                    if (j + u > lim + 1) S[rr * ld + j + u] = -INFINITY;")),
    M("kernel_rows_not_zeroed", "sparsespec/kernels/cpu/sparsespec_cpu.c", "importance rows keep garbage past a row's keys",
      ("        for (int64_t j = jv; j < j1; ++j) dst[j] = 0.0f;", "")),
    M("kernel_chunks_not_rescaled", "sparsespec/kernels/cpu/sparsespec_cpu.c", "chunk partials combined without exp(m_c - M)",
      ("            f[c] = exp1(it[r] - m);", "            f[c] = it[r] == -INFINITY ? 0.0f : 1.0f;")),
    M("kernel_bias_dropped", "sparsespec/kernels/cpu/sparsespec_cpu.c", "the packed linear forgets the bias",
      ("        if (bias) s += bias[u];\n        if (acc) yr[u] += s; else yr[u] = s;\n    }\n}",
       "        if (acc) yr[u] += s; else yr[u] = s;\n    }\n}")),
    M("kernel_kv_written_one_late", "sparsespec/kernels/cpu/sparsespec_cpu.c", "new k, v written one position late",
      ("        const int64_t slot = (pos ? pos[b] : 0) + t;", "        const int64_t slot = (pos ? pos[b] : 0) + t + (pos != NULL);")),
    M("kernel_draft_tail_hidden", "sparsespec/kernels/cpu/sparsespec_cpu.c", "a draft query does not see its own tail slot",
      ("    return a->sparse ? nv + a->E - a->T + t : a->starts[b] + t;",
       "    return a->sparse ? nv + a->E - a->T + t - 1 : a->starts[b] + t;")),
    M("kernel_layers_wrong_norm", "sparsespec/kernels/cpu/sparsespec_cpu.c", "the one-call layers normalise the MLP input with ln_attn",
      ("            rms_body(BT, E, f->h, E, f->ln_mlp[l], (float)f->eps, f->x, E);",
       "            rms_body(BT, E, f->h, E, f->ln_attn[l], (float)f->eps, f->x, E);")),
    M("kernel_silu_as_relu", "sparsespec/kernels/cpu/sparsespec_cpu.c", "SiLU replaced by ReLU in the fused op",
      ("            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));",
       "            __m256 s = _mm256_max_ps(gv, zero);")),
    M("plan_panels_stale", "sparsespec/kernels/plan.py", "the panel copy is made once and never refreshed",
      ("        if plan.uses_panels and cpu.supports(w) and w.dim() == 2 and cpu.available():",
       "        if plan.uses_panels and cpu.supports(w) and w.dim() == 2 and cpu.available() and not hasattr(w, PANELS_ATTR):")),
    M("kernel_features_wrong_layer", "sparsespec/kernels/cpu/sparsespec_cpu.c",
      "the one-call layers copy the next layer's output as an EAGLE-3 feature",
      ("if (f->feat_layers[j] != l) continue;", "if (f->feat_layers[j] != l + 1) continue;")),
    M("kernel_features_one_slot", "sparsespec/kernels/cpu/sparsespec_cpu.c",
      "every requested layer's features land in slot 0",
      ("memcpy(f->feat + r * f->feat_ld + j * E,", "memcpy(f->feat + r * f->feat_ld,")),
    M("kernel_features_repeat_dropped", "sparsespec/kernels/cpu/sparsespec_cpu.c",
      "a layer requested twice fills only its first slot",
      ("if (f->feat_layers[j] != l) continue;", "if (f->feat_layers[j] != l) continue; if (j > 1) break;")),
    M("kernel_kt_tree_regrouped", "sparsespec/kernels/cpu/sparsespec_cpu.c",
      "the keys-in-lanes tiles add the chain sums in another tree (other bits than a decode step's)",
      ("_mm512_add_ps(_mm512_add_ps(KT_L(0), KT_L(1)), _mm512_add_ps(KT_L(2), KT_L(3)))",
       "_mm512_add_ps(_mm512_add_ps(KT_L(0), KT_L(2)), _mm512_add_ps(KT_L(1), KT_L(3)))")),
    M("kernel_kt_second_half_keys", "sparsespec/kernels/cpu/sparsespec_cpu.c",
      "the transpose gives keys 16-31 of a block the first 16 keys' values",
      ("rp[u] = kp[16 * h + u < nk ? 16 * h + u : 0];", "rp[u] = kp[u < nk ? u : 0];")),
    M("kernel_kt_causal_tail", "sparsespec/kernels/cpu/sparsespec_cpu.c",
      "a wide verify's query sees the next draft's key (keys-in-lanes path)",
      ("                    for (int u = 0; u < nk; ++u)\n                        if (j + u > lim) S[rr * ld + j + u] = -INFINITY;\n                }\n        }\n    } else",
       "                    for (int u = 0; u < nk; ++u)\n                        if (j + u > lim + 1) S[rr * ld + j + u] = -INFINITY;\n                }\n        }\n    } else")),
    # ---- the prefill attention (flash, rows in lanes)
    M("kernel_prefill_sees_next_key", "sparsespec/kernels/cpu/sparsespec_cpu.c",
      "a prefill query sees the key after its own position",
      ("_mm512_cmp_epi32_mask(_mm512_set1_epi32((int32_t)(j0 + j)), lv, _MM_CMPINT_LE)",
       "_mm512_cmp_epi32_mask(_mm512_set1_epi32((int32_t)(j0 + j - 1)), lv, _MM_CMPINT_LE)")),
    M("kernel_prefill_no_rescale", "sparsespec/kernels/cpu/sparsespec_cpu.c",
      "the online softmax does not rescale the running output when a row's max grows",
      ("        const __m512 al = _mm512_set1_ps(alpha[i]);", "        const __m512 al = _mm512_set1_ps(1.0f);")),
    M("kernel_prefill_sum_unscaled", "sparsespec/kernels/cpu/sparsespec_cpu.c",
      "the online softmax's running sum l is not rescaled by alpha",
      ("_mm512_fmadd_ps(_mm512_load_ps(l + r), al, _mm512_add_ps(sum0, sum1))",
       "_mm512_add_ps(_mm512_load_ps(l + r), _mm512_add_ps(sum0, sum1))")),
    M("kernel_prefill_skips_an_active_row", "sparsespec/kernels/cpu/sparsespec_cpu.c",
      "the first row that sees a block (on the causal diagonal) skips its P.V",
      ("            for (int64_t r = ra; r < R; r += 6) {\n                const int MR = (int)(R - r < 6 ? R - r : 6);\n                const float *Pr = ST + r,",
       "            for (int64_t r = ra + (ra > 0); r < R; r += 6) {\n                const int MR = (int)(R - r < 6 ? R - r : 6);\n                const float *Pr = ST + r,")),
    M("kernel_prefill_last_partial_group", "sparsespec/kernels/cpu/sparsespec_cpu.c",
      "a partial group of keys at a prompt's end reads key j0 for all eight",
      ("memcpy(kbuf + w * D, kb + (j0 + (u + w < nk ? u + w : 0)) * D, (size_t)D * sizeof(float));",
       "memcpy(kbuf + w * D, kb + (j0 + 0) * D, (size_t)D * sizeof(float));")),
    M("kernel_pv_tile_alpha_dropped", "sparsespec/kernels/cpu/sparsespec_cpu.c",
      "the shared P.V tile starts every prefill block from 0 (the running output is lost)",
      ("    if (alpha && MR > i) {", "    if (0 && alpha && MR > i) {")),
    M("kernel_prefill_plan_ignored", "sparsespec/model.py",
      "the model never runs the prefill attention the plan chose",
      ('if ours and self.kernel_plan.prefill_attention == "ss" and cpu.prefill_attention_supported(q.shape[-1]):',
       'if False:')),
    M("kernel_kt_vprefetch_ignored", "sparsespec/kernels/plan.py",
      "a plan's choice of the keys-in-lanes value fetch is never applied",
      ("            cpu.set_attention_kt_vprefetch(plan.attention_kt_vprefetch if plan.attention_tiles else\n"
       "                                           cpu.attention_kt_vprefetch())", "            pass")),
    M("kernel_kt_variant_inverted", "sparsespec/kernels/plan.py",
      "the trial keeps the slower of the two value fetches",
      ('    if both and sum(v["ss-kt-late"] for v in both) < sum(v["ss-kt"] for v in both):',
       '    if both and sum(v["ss-kt-late"] for v in both) > sum(v["ss-kt"] for v in both):')),
    M("kernel_pv_prefetch_ignored", "sparsespec/kernels/plan.py",
      "a plan's P.V value fetch distance is never applied",
      ("            cpu.set_attention_pv_prefetch(pv)\n            cpu.set_attention_next_kprefetch(",
       "            pass\n            cpu.set_attention_next_kprefetch(")),
    M("kernel_pv_prefetch_inverted", "sparsespec/kernels/plan.py",
      "the trial keeps the slower of the P.V's two value fetches",
      ("    if ratios and math.prod(ratios) < 1.0:", "    if ratios and math.prod(ratios) > 1.0:")),
    M("kernel_pv_prefetch_trial_same", "sparsespec/kernels/plan.py",
      "the trial's pv-off variant runs with the fetch on (it times the same kernel twice)",
      ("_with_setting(ours, cpu.set_attention_pv_prefetch, 0, cpu.PV_PREFETCH_KEYS)",
       "_with_setting(ours, cpu.set_attention_pv_prefetch, cpu.PV_PREFETCH_KEYS, cpu.PV_PREFETCH_KEYS)")),
    M("kernel_five_pair_tile_drops_ninth_row", "sparsespec/kernels/cpu/sparsespec_cpu.c",
      "the five-pair tile stores no scores for its fifth pair",
      ("    if (NP == 5) sc512_store(", "    if (NP == 6) sc512_store(")),
    M("kernel_odd_row_store_wrong_key", "sparsespec/kernels/cpu/sparsespec_cpu.c",
      "a decode's third row stores its four scores one key late",
      ("_mm_storeu_ps(S + r * ld + j, _mm256_castps256_ps128(s8));\n            } else {",
       "_mm_storeu_ps(S + r * ld + j + 1, _mm256_castps256_ps128(s8));\n            } else {")),
    M("kernel_linear_bias_dropped_full_panel", "sparsespec/kernels/cpu/sparsespec_cpu.c",
      "a full panel of the AVX-512 packed linear drops its bias",
      ("        if (bias) c = _mm512_add_ps(c, _mm512_loadu_ps(bias));\n", "")),
    M("kernel_verify_kprefetch_ignored", "sparsespec/kernels/plan.py",
      "a plan's next-key fetch for row-pair verifies is never applied",
      ("            cpu.set_attention_verify_kprefetch(_env_keys(", "            (_env_keys(")),
    M("kernel_verify_kprefetch_inverted", "sparsespec/kernels/plan.py",
      "the trial keeps the slower of a verify's two next-key fetches",
      ('    return 0 if r < 1.0 else cpu.VERIFY_KPREFETCH_T', '    return 0 if r > 1.0 else cpu.VERIFY_KPREFETCH_T')),
    M("kernel_verify_kprefetch_trial_same", "sparsespec/kernels/plan.py",
      "the trial's verify nk-off variant runs with the fetch on",
      ("_with_setting(verify, cpu.set_attention_verify_kprefetch, 0,",
       "_with_setting(verify, cpu.set_attention_verify_kprefetch, cpu.VERIFY_KPREFETCH_T,")),
    M("kernel_pv_prefetch_past_chunk", "sparsespec/kernels/cpu/sparsespec_cpu.c",
      "the setter lets the fetch distance run past a chunk",
      ("keys_ahead > SS_CHUNK ? SS_CHUNK : keys_ahead;", "keys_ahead;")),
    M("kernel_linear_wide_prefetch_ignored", "sparsespec/kernels/plan.py",
      "a plan's fetch distance for the packed linear's wide rows is never applied",
      ("        lw = cpu.set_linear_wide_prefetch(lw) if cpu.available() else lw\n", "")),
    M("kernel_linear_wide_prefetch_inverted", "sparsespec/kernels/plan.py",
      "the trial keeps the slower of the linear's two fetch distances",
      ("ratios and math.prod(ratios) < 1.0 else cpu.LINEAR_WIDE_PREFETCH_ROWS",
       "ratios and math.prod(ratios) > 1.0 else cpu.LINEAR_WIDE_PREFETCH_ROWS")),
    M("kernel_linear_wide_prefetch_trial_same", "sparsespec/kernels/plan.py",
      "the linear fetch trial's far variant runs with the near distance",
      ("_with_setting(run, cpu.set_linear_wide_prefetch, cpu.LINEAR_WIDE_PREFETCH_FAR,",
       "_with_setting(run, cpu.set_linear_wide_prefetch, cpu.LINEAR_WIDE_PREFETCH_ROWS,")),
    M("kernel_trial_packs_every_weight", "sparsespec/kernels/plan.py",
      "the linear trial copies every weight, not only the layers it times",
      ("    used = max(sels.values(), key=len)  # each selection is a prefix of ``weights``",
       "    used = weights")),
    M("kernel_trial_no_byte_cap", "sparsespec/kernels/plan.py",
      "the linear trial streams ~1 GFLOP at a memory-bound width of a large model (2 GB at M = 1)",
      ("lambda n, m=m: 2 * m * n >= 1e9 or 4 * n >= TRIAL_STREAM_BYTES)", "lambda n, m=m: 2 * m * n >= 1e9)")),
    M("kernel_fetch_trial_every_weight", "sparsespec/kernels/plan.py",
      "the linear fetch trial streams every weight of a large model",
      ("    sel = _first_layers(_weights(model), lambda n: 4 * n >= TRIAL_STREAM_BYTES)  # fp32 panels",
       "    sel = _weights(model)")),
    M("kernel_confirm_copies_for_nothing", "sparsespec/kernels/plan.py",
      "the forward trial copies the weights where it has no range to confirm",
      ("        return list(choice), {}  # nothing to confirm", "        pass  # nothing to confirm")),
    M("kernel_decode_kprefetch_ignored", "sparsespec/kernels/plan.py",
      "a plan's far key fetch for one-token forwards is never applied",
      ("        cpu.set_attention_decode_kprefetch(dk)\n        att = ", "        att = ")),
    M("kernel_decode_kprefetch_inverted", "sparsespec/kernels/plan.py",
      "the trial keeps the slower of the two key fetches",
      ('v.get("ss-dk-off/ss", 1.0) < 1.0 else cpu.DECODE_KPREFETCH_KEYS',
       'v.get("ss-dk-off/ss", 1.0) > 1.0 else cpu.DECODE_KPREFETCH_KEYS')),
    M("kernel_decode_kprefetch_trial_same", "sparsespec/kernels/plan.py",
      "the trial's dk-off variant runs with the fetch on",
      ("_with_setting(ours, cpu.set_attention_decode_kprefetch, 0,",
       "_with_setting(ours, cpu.set_attention_decode_kprefetch, cpu.DECODE_KPREFETCH_KEYS,")),
    M("kernel_next_kprefetch_ignored", "sparsespec/kernels/plan.py",
      "a plan's choice of the P.V's fetch of the next chunk's keys is never applied",
      ("            cpu.set_attention_next_kprefetch(_env_switch(", "            (_env_switch(")),
    M("kernel_next_kprefetch_inverted", "sparsespec/kernels/plan.py",
      "the trial keeps the slower of the two next-key fetches",
      ('.get("ss-nk-off/ss", 1.0) < 1.0', '.get("ss-nk-off/ss", 1.0) > 1.0')),
    M("kernel_fetch_trial_batch1", "sparsespec/kernels/plan.py",
      "the fetch trial runs at batch 1 (where its choices sit within the noise)",
      ("FETCH_TRIAL_BATCH, FETCH_TRIAL_REPS = 4, 9", "FETCH_TRIAL_BATCH, FETCH_TRIAL_REPS = 1, 9")),
    M("kernel_fetch_trial_seconds", "sparsespec/kernels/plan.py",
      "the fetch trial's decisions read median seconds instead of the median time ratios",
      ('            out[f"{name}/ss"] = statistics.median(t / b for t, b in zip(times[name], base))',
       '            out[f"{name}/ss"] = out[name] / out["ss"]')),
    M("kernel_fetch_trial_verify_against_decode", "sparsespec/kernels/plan.py",
      "the fetch trial's verify variants are judged against the decode's time",
      ('            base = times[f"{prefix}:ss" if prefix else "ss"]', '            base = times["ss"]')),
    M("kernel_fetch_trial_no_verify", "sparsespec/kernels/plan.py",
      "the P.V value fetch is decided at the decode width only",
      ('        fns[f"T{verify_t}:ss"] = verify\n', '')),
    M("kernel_next_kprefetch_trial_same", "sparsespec/kernels/plan.py",
      "the trial's nk-off variant runs with the fetch on",
      ("_with_setting(ours, cpu.set_attention_next_kprefetch, False, True)",
       "_with_setting(ours, cpu.set_attention_next_kprefetch, True, True)")),
    M("kernel_next_kprefetch_env_inverted", "sparsespec/kernels/plan.py",
      "SPARSESPEC_ATTENTION_NEXT_KPREFETCH=1 switches the fetch off",
      ('    return env == "1"', '    return env == "0"')),
    # ---- the draft's compact KV (sparsespec/drafters/sparse_self.py CompactDraftKV, ss_compact_update)
    M("compact_kept_not_moved", "sparsespec/kernels/cpu/sparsespec_cpu.c",
      "a kept position whose slot lies past a shrunk index stays there (slot >= N)",
      ("            if (s >= n) {", "            if (0 && s >= n) {")),
    M("compact_copies_neighbour", "sparsespec/kernels/cpu/sparsespec_cpu.c",
      "an entering position copies its neighbour's cache row",
      ("            memcpy(ck + s * D, k + b * c_row, row);", "            memcpy(ck + s * D, k + (b ^ 1) * c_row, row);")),
    M("compact_value_row_kept_stale", "sparsespec/kernels/cpu/sparsespec_cpu.c",
      "an entering position copies its key row but not its value row",
      ("            memcpy(cv + s * D, v + b * c_row, row);", "")),
    M("compact_not_forgotten", "sparsespec/drafters/sparse_self.py",
      "a new request in a slot keeps the previous request's compact rows",
      ("        self.n[b], self.built_from[b] = 0, None", "        self.built_from[b] = None")),
    # ---- draft-model's catch-up (sparsespec/drafters/draft_model.py DraftModelDrafter._catch_up)
    M("draft_catch_up_rows_advance_by_padding", "sparsespec/drafters/draft_model.py",
      "after the padded catch-up every row's length advances by the longest catch-up",
      ("            dc.lengths = [s + len(x) for s, x in zip(starts, lack)]",
       "            dc.lengths = [s + T for s in starts]")),
    M("draft_catch_up_pads_past_capacity", "sparsespec/drafters/draft_model.py",
      "the padded catch-up runs where the padding does not fit the draft cache",
      ("2 * len(lagging) >= B and max(dc.lengths) + T <= dc.capacity:", "2 * len(lagging) >= B:")),
    M("draft_catch_up_never_padded", "sparsespec/drafters/draft_model.py",
      "every lagging row catches up alone (one weight read per row)",
      ("        if len(lagging) >= 2 and 2 * len(lagging) >= B", "        if len(lagging) >= 99 and 2 * len(lagging) >= B")),
    M("compact_move_state_only", "sparsespec/drafters/sparse_self.py",
      "a moved row takes the state but not the compact rows",
      ("        self.k[:, dst, :, :n] = self.k[:, src, :, :n]\n        self.v[:, dst, :, :n] = self.v[:, src, :, :n]\n", "")),
]


def run_one(m: Mutant, root: Path, tests: list[str], timeout: float) -> dict:
    src = (root / m.path).read_text()
    for old, new in m.variants:
        if old in src:
            break
    else:
        return {"name": m.name, "status": "n/a", "what": m.what}
    tmp = Path(tempfile.mkdtemp(prefix=f"mut-{m.name}-"))
    try:
        for d in ("sparsespec", "tests", "cluster", "evals", "dashboard"):
            if (root / d).exists():
                shutil.copytree(root / d, tmp / d, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(root / "pyproject.toml", tmp / "pyproject.toml")
        (tmp / m.path).write_text(src.replace(old, new, 1))
        env = dict(os.environ, PYTHONPATH=str(tmp), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
        present = [t for t in tests if (tmp / t).exists()]
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-m", "not slow and not gpu", "-p", "no:cacheprovider",
               *present]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
            status = "survived" if p.returncode == 0 else "killed"
            tail = (p.stdout.strip().splitlines() or [""])[-1]
        except subprocess.TimeoutExpired:
            status, tail = "killed", "timeout"
        return {"name": m.name, "status": status, "what": m.what, "seconds": round(time.perf_counter() - t0, 1),
                "result": tail}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="tree to mutate (default: this checkout)")
    ap.add_argument("--only", default="", help="comma list of mutant names")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not a.only or m.name in a.only.split(",")]
    clean = run_one(M("unmutated", "sparsespec/engine.py", "no change", ("", "")), a.root.resolve(), FAST_TESTS,
                    a.timeout)
    print(f"unmutated tree: {clean['status']} in {clean['seconds']} s ({clean['result']})")
    if clean["status"] != "survived":  # every mutant would count as killed
        print("the unmutated tree fails its fast tests: no score")
        return 1
    with cf.ThreadPoolExecutor(max_workers=a.jobs) as pool:
        results = list(pool.map(lambda m: run_one(m, a.root.resolve(), FAST_TESTS, a.timeout), chosen))
    for r in results:
        print(f"{r['status']:9s} {r['name']:28s} {r.get('seconds', ''):>7} {r['what']}")
    applicable = [r for r in results if r["status"] != "n/a"]
    killed = sum(r["status"] == "killed" for r in applicable)
    print(f"\nscore: {killed}/{len(applicable)} killed ({len(results) - len(applicable)} n/a)")
    if a.json_out:
        a.json_out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
