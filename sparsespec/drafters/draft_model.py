"""Standalone draft model (Leviathan et al. 2023; Chen et al. 2023): a separate, smaller causal LM
that shares the target's tokenizer proposes K tokens autoregressively with its own dense KV cache.

Option: ``method_options={"draft_model": <preset or local HF folder>}`` (required). Production
pairs (same tokenizer, presets in ``sparsespec.provision``):

* ``llama-3.2-1b`` (Llama-3.2-1B-Instruct) drafting for ``llama-3.1-8b`` (Llama-3.1-8B-Instruct)
  (or for ``llama-3.2-3b``);
* ``qwen2.5-0.5b`` (Qwen2.5-0.5B-Instruct) drafting for ``qwen2.5-7b`` / ``qwen2.5-14b``.

The draft model is loaded once per (folder, dtype, device) and kept at module level; a draft
folder equal to the target's reuses the target's weights (the target drafting for itself with
full attention: alpha = 1 greedy, a useful upper bound and plumbing check). Both tokenizers must
have identical vocabularies and the two configs equal ``vocab_size`` (``ValueError`` otherwise).

Draft cache. It mirrors the target's: every committed token of a row but the pending one. A step
(``propose``) first catches up the committed tokens the draft cache lacks (after a fully accepted
step the last draft token's KV was never computed) and feeds the pending token in the same
forward, then drafts with one ``T = 1`` forward per token over the ragged batch. Rows that lack
more (steps that drafted nothing: ``k="auto"`` declining) first catch up in one padded forward over
the batch (``_catch_up``). ``commit`` rolls
each row back to ``min(draft length, target committed length)``: accepted drafts are exactly the
committed tokens, so the kept prefix is valid; rejected drafts are forgotten by length.

Context window: **per-row fallback, not windowing.** The draft model may have a shorter window
(``max_position_embeddings``) than the request. Row ``b`` drafts at most ``window - P_b`` tokens,
``P_b`` being its pending token's position (the last draft is predicted from position
``window - 1``); a row with ``P_b >= window`` (including a prompt that does not fit the draft
window: it is never prefilled into the draft cache) is *retired*: it drafts nothing from then on
(``num_draft = 0``, so the engine verifies only its pending token: plain AR for that row) and its
draft cache stays empty. Windowing the draft context (sink + recent tokens, re-encoded at new
positions) would keep drafting but needs a re-prefill whenever the window slides and drafts from a
context the draft model never saw in training; the fallback is simpler, costs nothing on retired
rows and is trivially lossless (the target verifies everything either way).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from sparsespec.config import SpecOptions
from sparsespec.drafters.base import Draft, draft_loop, empty_draft
from sparsespec.kv.cache import KVCache
from sparsespec.model import Transformer
from sparsespec.provision import ModelNotAvailableError, resolve_model
from sparsespec.registry import DRAFTERS, MethodUnavailable
from sparsespec.sampling import BatchSampling

# (folder, dtype, device) -> loaded draft model; repeated generate calls reuse it
_MODELS: dict[tuple[str, torch.dtype, str], Transformer] = {}
# (target folder, draft folder) -> None (same tokenizer) or the mismatch message
_TOKENIZER_VERDICTS: dict[tuple[str, str], str | None] = {}


def load_draft_model(folder: Path, dtype: torch.dtype, device) -> Transformer:
    """The draft model of ``folder`` in ``dtype`` on ``device``, loaded once per process."""
    key = (str(Path(folder).resolve()), dtype, str(torch.device(device)))
    if key not in _MODELS:
        _MODELS[key] = Transformer.from_folder(folder, dtype=dtype, device=device)
    return _MODELS[key]


def _tokenizer_mismatch(target_folder: Path, draft_folder: Path) -> str | None:
    """None if both folders' tokenizers have identical vocabularies, else why not (cached)."""
    key = (str(Path(target_folder).resolve()), str(Path(draft_folder).resolve()))
    if key[0] == key[1]:
        return None
    if key not in _TOKENIZER_VERDICTS:
        from transformers import AutoTokenizer

        vocabs = []
        for folder in (target_folder, draft_folder):
            try:
                vocabs.append(AutoTokenizer.from_pretrained(folder).get_vocab())
            except Exception as e:  # noqa: BLE001 - any failure: we cannot show they match
                _TOKENIZER_VERDICTS[key] = f"cannot load the tokenizer of {folder} ({e!r})"
                break
        else:
            t, d = vocabs
            if t != d:
                diff = len(set(t.items()) ^ set(d.items()))
                _TOKENIZER_VERDICTS[key] = f"vocabularies differ ({len(t)} vs {len(d)} tokens, {diff} entries differ)"
            else:
                _TOKENIZER_VERDICTS[key] = None
    return _TOKENIZER_VERDICTS[key]


@dataclass(frozen=True)
class DraftModelOptions(SpecOptions):
    """``draft-model``'s options (``SpecOptions`` plus):

    Attributes:
        draft_model: preset name or local Hugging Face folder of the draft model (required;
            resolved when the drafter loads, so a missing folder is reported then).
    """

    draft_model: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.draft_model is None:
            raise ValueError("draft-model needs method_options={'draft_model': <preset or path>}")
        if not isinstance(self.draft_model, str) or not self.draft_model:
            raise ValueError(f"draft_model must be a preset name or a folder, got {self.draft_model!r}")


@DRAFTERS.register("draft-model")
class DraftModelDrafter:
    """A separate causal LM drafts with its own ragged KV cache; see the module docstring."""

    options = DraftModelOptions

    want_rows = 0
    want_rows_prefill = 0
    want_hidden = ()
    draft_cost_prior = 0.3  # the cost controller's prior for C_d / C_v(B, 1, N): a smaller model's forward

    def __init__(self, model: Transformer, spec: DraftModelOptions, capacity: int, batch_size: int, max_k: int):
        try:
            folder = resolve_model(spec.draft_model)
        except ModelNotAvailableError as e:
            raise MethodUnavailable(f"draft model {spec.draft_model!r} is not available here: {e}") from None
        same = model.source_folder is not None and Path(folder).resolve() == Path(model.source_folder).resolve()
        self.draft = model if same else load_draft_model(folder, model.dtype, model.device)
        dcfg = self.draft.cfg
        if dcfg.vocab_size != model.cfg.vocab_size:
            raise MethodUnavailable(
                f"tokenizer mismatch between the target {model.source_folder} and the draft model "
                f"{spec.draft_model!r} ({folder}): vocab_size {model.cfg.vocab_size} vs {dcfg.vocab_size}"
            )
        if model.source_folder is not None:  # a model built in memory has no tokenizer to compare
            why = _tokenizer_mismatch(model.source_folder, folder)
            if why is not None:
                raise MethodUnavailable(
                    f"tokenizer mismatch between the target {model.source_folder} and the draft model "
                    f"{spec.draft_model!r} ({folder}): {why}"
                )
        self.spec = spec
        self.folder = Path(folder)
        self.window = dcfg.max_position_embeddings
        # positions written stay < window + max_k (see propose) and < the target's capacity
        cap = min(capacity, self.window + max_k + 1)
        self.dcache = KVCache(dcfg, batch_size, cap, model.dtype, model.device)  # [L, B, H_kv, S_max, D]
        self.retired = [False] * batch_size  # rows whose context no longer fits the draft window

    # ------------------------------------------------------------------ protocol
    def provenance(self) -> dict:
        """What every request's stats record about this drafter (``RunStats.drafter``): the draft
        model's folder, and its provisioned preset and GGUF sha256 where it has a record."""
        info = {"path": str(self.folder.resolve())}
        try:
            prov = json.loads((self.folder / "sparsespec_provenance.json").read_text())
            info.update(preset=prov.get("preset"), sha256=prov.get("sha256"))
        except (OSError, ValueError, AttributeError):
            pass  # not a provisioned preset (a user's folder): its path only
        return {"draft_model": info}

    def prefill_row(self, b: int, cache: KVCache, rows: torch.Tensor | None, prompt: Sequence[int] = ()) -> None:
        self.retired[b] = False  # a new request in this slot
        if len(prompt) >= self.window:  # the pending token (position len(prompt)) would not fit
            self.retired[b] = True
            self.dcache.lengths[b] = 0
            return
        view = self.dcache.row(b)
        view.rollback(0)
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=self.draft.device)  # [1, P]
        self.draft.prefill(ids, view)
        self.dcache.lengths[b] = view.lengths[0]

    def propose(self, cache: KVCache, pending: torch.Tensor, limits: Sequence[int], policies: Sequence,
                sampling: BatchSampling, history: Sequence[Sequence[int]] = ()) -> Draft:
        B = pending.shape[0]
        if len(history) != B:
            raise ValueError("draft-model needs the token history of every row")
        dev = self.draft.device
        row_limits = []
        for b in range(B):
            P = len(history[b]) - 1  # position of the pending token
            if not self.retired[b] and P >= self.window:
                self.retired[b] = True
                self.dcache.lengths[b] = 0
            row_limits.append(0 if self.retired[b] else max(0, min(int(limits[b]), self.window - P)))
        if max(row_limits, default=0) == 0:
            return empty_draft(pending)
        dc = self.dcache.head(B)  # the running rows' slots
        for b in range(B):
            if not self.retired[b]:
                dc.lengths[b] = min(dc.lengths[b], len(history[b]) - 1)
        self._catch_up(dc, history)

        # row b feeds history[b][dlen_b:]: at most its last committed token and the pending one
        feed: list[list[int]] = []
        for b in range(B):
            feed.append([int(history[b][-1])] if self.retired[b] else [int(t) for t in history[b][dc.lengths[b]:]])
        T = max(len(f) for f in feed)  # 1, or 2 after a fully accepted step
        inp = torch.tensor([f + [f[-1]] * (T - len(f)) for f in feed], dtype=torch.long, device=dev)  # [B, T]
        starts = list(dc.lengths)
        last = torch.tensor([len(f) - 1 for f in feed], device=dev)  # [B] index of the pending token

        def step(tok: torch.Tensor, j: int) -> torch.Tensor:
            if j == 0:
                # padded tail positions are written past the row's length: garbage, overwritten later
                logits, _ = self.draft.forward_dense(inp, dc)  # [B, T, V]
                dc.lengths = [s + len(f) for s, f in zip(starts, feed)]
                return logits[torch.arange(B, device=dev), last]  # [B, V]
            logits, _ = self.draft.forward_dense(tok, dc, logits_for="last")  # [B, 1, V]
            return logits[:, -1]

        try:
            return draft_loop(step, pending, row_limits, policies, sampling)  # limits: budget, window, retired
        finally:
            self.dcache.lengths[:B] = dc.lengths

    def _catch_up(self, dc: KVCache, history: Sequence[Sequence[int]]) -> None:
        """Feed each running row that lacks more than its last committed token (after ``r`` steps
        that drafted nothing, e.g. ``k="auto"`` declining, it lacks ``r + 1``) all its lacking
        committed tokens, ``history[b][len_b:-1]``, so that its feed is the pending token alone.

        Where at least half the rows lag (after declined steps every row does), one forward over
        the batch, each row padded to the longest catch-up: one read of the draft's weights
        instead of one per row. Padding is written past a row's length (never read, overwritten
        later), so a batch whose longest row would overflow the draft cache, or where few rows
        lag, catches up row by row. ``dc``: the running rows' view; its ``lengths`` advance."""
        B = len(history)
        lack = [[] if self.retired[b] or len(history[b]) - dc.lengths[b] <= 2
                else [int(t) for t in history[b][dc.lengths[b]:-1]] for b in range(B)]
        lagging = [b for b in range(B) if lack[b]]
        if not lagging:
            return
        dev = self.draft.device
        T = max(len(x) for x in lack)
        if len(lagging) >= 2 and 2 * len(lagging) >= B and max(dc.lengths) + T <= dc.capacity:
            filler = [x + [x[-1]] * (T - len(x)) if x else [int(h[-1])] * T for x, h in zip(lack, history)]
            starts = list(dc.lengths)
            self.draft.forward_dense(torch.tensor(filler, dtype=torch.long, device=dev), dc,
                                     logits_for="last")  # [B, T] in, logits not needed
            dc.lengths = [s + len(x) for s, x in zip(starts, lack)]
            return
        for b in lagging:  # row by row: a chunked prefill of its own
            view = dc.row(b)
            self.draft.prefill(torch.tensor([lack[b]], dtype=torch.long, device=dev), view)
            dc.lengths[b] = view.lengths[0]

    def commit(self, cache: KVCache, rows: torch.Tensor | None, counts: Sequence[int]) -> None:
        for b in range(cache.batch_size):
            self.dcache.lengths[b] = 0 if self.retired[b] else min(self.dcache.lengths[b], cache.lengths[b])

    def move(self, src: int, dst: int) -> None:
        self.dcache.move(src, dst)
        self.retired[dst] = self.retired[src]

    def index_sizes(self) -> list[int]:
        return [0 if r else n for r, n in zip(self.retired, self.dcache.lengths)]

    @property
    def nbytes(self) -> int:
        return self.dcache.nbytes
