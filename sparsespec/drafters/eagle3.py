"""``eagle3``: an EAGLE-3 draft head (``sparsespec.eagle3_head``) drafts from the target's own hidden
states, chain drafting up to K tokens, verified by the same lossless verifier as every method.

Option: ``method_options={"draft_model": <head folder or hub id>}``; default: the head trained
on this machine for the target (``python -m sparsespec.train_eagle3``), under
``$SPARSESPEC_CACHE/eagle3/<target folder name>``, else the head shipped in the package for the
target's preset (``sparsespec/heads/<preset>/``: bf16 weights whose sha256 its ``manifest.json``
records and ``shipped_head`` checks, used only for the exact weights it was trained on). A hub id
is downloaded only where the hub is reachable (``huggingface_hub.snapshot_download``); offline it
must be a local folder.

State per slot. The head keeps its own one-layer KV cache over *pairs*: position ``t`` holds (the
target's fused features at ``t``, token ``x_{t+1}``). The engine hands the drafter the target's
features at every committed position (the prefill's, then each verify's ``counts[b]`` committed
ones, ``want_hidden``); features whose next token is not committed yet wait in ``pending[b]``.

* ``prefill_row``: pairs ``0 .. P-2`` of the prompt (chunked), feature ``P-1`` pending.
* ``propose``: one catch-up forward feeds every row's pending features with their next tokens (the
  last is the pending token), ragged; its last output predicts the first draft token. Each later
  draft step feeds (the head's own output hidden, the token it drafted) at the next position.
* ``commit``: roll the head's cache back to the pairs built from target features (``valid[b]``;
  the draft steps' pairs used the head's own hidden states and are recomputed from the target's
  features next step, as EAGLE does) and queue the committed positions' features.

Invariant (checked): ``valid[b] + len(pending[b])`` = the target's committed length of row b.
The draft attends to the whole context (one layer), so its cost grows with the context: that and
the acceptance measured at long context are what this baseline is here to show.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from sparsespec.config import SpecOptions
from sparsespec.drafters.base import Draft, draft_loop, empty_draft
from sparsespec.eagle3_head import Eagle3Head
from sparsespec.kv.cache import KVCache
from sparsespec.model import Transformer
from sparsespec.registry import DRAFTERS, MethodUnavailable
from sparsespec.sampling import BatchSampling

# (head folder, target folder or id, dtype, device) -> loaded head
_HEADS: dict[tuple, Eagle3Head] = {}
PREFILL_CHUNK = 512


def trained_head_dir(target_name: str) -> Path:
    """Where ``sparsespec.train_eagle3`` saves (and ``eagle3`` looks for) the head of a target."""
    from sparsespec.provision import cache_dir

    return cache_dir() / "eagle3" / target_name


#: Heads shipped in the package, one folder per model preset (``sparsespec/heads/<preset>/``).
SHIPPED_HEADS = Path(__file__).resolve().parents[1] / "heads"
MANIFEST = "manifest.json"
_VERIFIED: dict[tuple, str] = {}  # (weights path, size, mtime) -> sha256 checked against its manifest


def verify_shipped(folder: Path) -> dict:
    """Check a shipped head's weights against its ``manifest.json``; returns the manifest.

    The manifest records ``weights_file``, its ``weights_sha256`` and ``weights_bytes``, and the
    ``target`` (preset name and the sha256 of the GGUF the target's weights come from).

    Raises:
        ValueError: a missing or malformed manifest, a missing weights file, or a size or sha256
            other than the manifest's (a corrupt or modified file), naming how to restore it.
    """
    from sparsespec.provision import sha256_file

    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        name, want, size = manifest["weights_file"], manifest["weights_sha256"], int(manifest["weights_bytes"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{folder / MANIFEST}: unreadable EAGLE-3 head manifest ({type(e).__name__}: {e})") from None
    path = folder / name
    restore = f"restore it with `git checkout -- {folder}` (or reinstall sparsespec)"
    if not path.is_file():
        raise ValueError(f"{path}: the shipped EAGLE-3 head's weights are missing; {restore}")
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _VERIFIED:
        if st.st_size != size:
            raise ValueError(f"{path}: {st.st_size} bytes, the manifest says {size}: the shipped EAGLE-3 head is "
                             f"corrupt or was modified; {restore}")
        got = sha256_file(path)
        if got != want:
            raise ValueError(f"{path}: sha256 {got} != {want} in its manifest: the shipped EAGLE-3 head is "
                             f"corrupt or was modified; {restore}")
        _VERIFIED[key] = got
    return manifest


def shipped_head(model: Transformer, root: Path | None = None) -> Path | None:
    """The head shipped for ``model``'s preset (under ``root``, default ``SHIPPED_HEADS``), or None.

    A head ships for exact target weights: the model's folder must carry the provisioning record
    (``sparsespec_provenance.json``) naming the manifest's preset and GGUF sha256. Its weights are
    then checked (``verify_shipped``: raises ValueError when corrupt).
    """
    if model.source_folder is None:
        return None
    try:
        prov = json.loads((Path(model.source_folder) / "sparsespec_provenance.json").read_text())
        preset, digest = str(prov["preset"]), prov["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not a provisioned preset: no shipped head applies
    folder = Path(root or SHIPPED_HEADS) / preset
    if not (folder / MANIFEST).is_file():
        return None
    manifest = verify_shipped(folder)
    target = manifest.get("target") or {}
    if target.get("preset") != preset or target.get("sha256") != digest:
        return None
    return folder


def resolve_head(model: Transformer, draft_model: str | None) -> Path:
    """The folder of the EAGLE-3 head for ``model``: ``draft_model`` as a local folder, else as a
    hub id (downloaded when the hub is reachable), else (None) the head trained on this machine
    for this target, else the head shipped for its preset (``shipped_head``).

    Raises:
        ValueError: no such folder, no head for the target, a shipped head that fails its
            checksum, or a hub id that cannot be fetched.
    """
    if draft_model is None:
        if model.source_folder is None:
            raise ValueError("eagle3 needs method_options={'draft_model': <EAGLE-3 head folder>} for a model "
                             "built in memory")
        folder = trained_head_dir(Path(model.source_folder).name)
        if (folder / "config.json").is_file():
            return folder
        shipped = shipped_head(model)
        if shipped is not None:
            return shipped
        raise MethodUnavailable(f"no EAGLE-3 head for {Path(model.source_folder).name} at {folder} (and none ships "
                                f"for it); train one with `python -m sparsespec.train_eagle3 --model "
                                f"{Path(model.source_folder).name}` or pass method_options={{'draft_model': "
                                f"<head folder or hub id>}}")
    path = Path(os.path.expanduser(draft_model))
    if path.is_dir():
        return path
    if path.is_absolute() or draft_model.startswith(".") or draft_model.count("/") != 1:
        raise ValueError(f"EAGLE-3 head {draft_model!r}: no such folder (and not a hub id 'owner/name')")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(draft_model, allow_patterns=["*.json", "*.safetensors", "*.bin"]))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, auth: all mean "not available"
        raise MethodUnavailable(f"EAGLE-3 head {draft_model!r} is not a local folder and could not be fetched from the "
                         f"hub ({type(e).__name__}: {e})") from None


def head_provenance(folder: Path) -> dict:
    """Which head a run drafted with: ``{"path", "source", "weights_sha256"}``. ``source`` is
    ``"shipped"`` (``SHIPPED_HEADS``: the manifest's sha256, checked at load), ``"trained"`` (this
    machine's ``trained_head_dir``) or ``"given"`` (a folder or hub snapshot the caller named); the
    sha256 of the weights files in load order otherwise (computed once per file version)."""
    from sparsespec.provision import sha256_file

    folder = Path(folder).resolve()
    if folder.parent == SHIPPED_HEADS.resolve() and (folder / MANIFEST).is_file():
        return {"path": str(folder), "source": "shipped", "weights_sha256": verify_shipped(folder)["weights_sha256"]}
    source = "trained" if folder == trained_head_dir(folder.name).resolve() else "given"
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    digests = []
    for f in files:
        st = f.stat()
        key = (str(f), st.st_size, st.st_mtime_ns)
        if key not in _VERIFIED:
            _VERIFIED[key] = sha256_file(f)
        digests.append(_VERIFIED[key])
    return {"path": str(folder), "source": source,
            "weights_sha256": digests[0] if len(digests) == 1 else (digests or None)}


def load_head(model: Transformer, folder: Path) -> Eagle3Head:
    """The head in ``folder`` for ``model`` (sharing its embedding), loaded once per process."""
    key = (str(Path(folder).resolve()), str(model.source_folder or id(model)), model.dtype, str(model.device))
    if key not in _HEADS:
        _HEADS[key] = Eagle3Head.load(folder, model.cfg, embed=model.embed, dtype=model.dtype, device=model.device)
    return _HEADS[key]


@dataclass(frozen=True)
class Eagle3Options(SpecOptions):
    """``eagle3``'s options (``SpecOptions`` plus):

    Attributes:
        draft_model: the EAGLE-3 head: a local folder or a hub id ``owner/name`` (``resolve_head``);
            None = the head trained here for the target.
    """

    draft_model: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.draft_model is not None and (not isinstance(self.draft_model, str) or not self.draft_model):
            raise ValueError(f"draft_model must be a head folder or hub id, got {self.draft_model!r}")


@DRAFTERS.register("eagle3")
class Eagle3Drafter:
    """EAGLE-3 chain drafting; see the module docstring."""

    options = Eagle3Options

    draft_cost_prior = 0.1  # the cost controller's prior for C_d / C_v(B, 1, N): a one-layer head

    want_rows = 0
    want_rows_prefill = 0

    def __init__(self, model: Transformer, spec: Eagle3Options, capacity: int, max_num_seqs: int, max_k: int,
                 head: Eagle3Head | None = None):
        self.model = model
        folder = resolve_head(model, spec.draft_model) if head is None else None
        self.head = head if head is not None else load_head(model, folder)
        self.head_info = head_provenance(folder) if folder is not None else {"source": "in memory"}
        self.want_hidden = tuple(self.head.cfg.aux_layers)
        model.check_hidden_layers(self.want_hidden)
        self.spec = spec
        self.hcache = KVCache(self.head.lcfg, max_num_seqs, capacity, self.head.dtype, model.device)  # [1, slots, H_kv, S, D]
        self.valid = [0] * max_num_seqs  # pairs in hcache built from target features
        self.pending: list[list[torch.Tensor]] = [[] for _ in range(max_num_seqs)]  # [n, 3 E_t] chunks per slot

    def provenance(self) -> dict:
        """What every request's stats record about this drafter (``RunStats.drafter``)."""
        return {"eagle3_head": self.head_info}

    def _npending(self, b: int) -> int:
        return sum(int(f.shape[0]) for f in self.pending[b])

    # ------------------------------------------------------------------ protocol
    def prefill_row(self, b: int, cache: KVCache, rows: torch.Tensor | None, prompt: Sequence[int] = (),
                    hidden: torch.Tensor | None = None) -> None:
        if hidden is None or hidden.shape[1] != len(prompt):
            raise ValueError("eagle3 needs the target's features of every prompt position (want_hidden)")
        P = len(prompt)
        view = self.hcache.row(b)
        view.lengths = [0]
        feats = hidden[0]  # [P, 3 E_t]
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=self.model.device)  # [1, P]
        for s in range(0, P - 1, PREFILL_CHUNK):  # pairs (f_t, x_{t+1}), t < P - 1
            e = min(s + PREFILL_CHUNK, P - 1)
            self.head.forward_cached(ids[:, s + 1 : e + 1], self.head.fuse(feats[None, s:e]), view)
        self.hcache.lengths[b] = self.valid[b] = view.lengths[0]
        self.pending[b] = [feats[P - 1 :]]

    def propose(self, cache: KVCache, pending: torch.Tensor, limits: Sequence[int], policies: Sequence,
                sampling: BatchSampling, history: Sequence[Sequence[int]] = ()) -> Draft:
        B = pending.shape[0]
        if len(history) != B:
            raise ValueError("eagle3 needs the token history of every row")
        hc = self.hcache.head(B)
        dev = self.model.device
        # catch-up: row b's pending features f_t (t = valid .. n-1) with tokens x_{t+1} (last = pending)
        counts, feats, toks = [], [], []
        for b in range(B):
            n = len(history[b]) - 1  # position of the pending token = committed length
            c = self._npending(b)
            if self.valid[b] + c != n:
                raise RuntimeError(f"eagle3 slot {b}: {self.valid[b]} pairs + {c} pending features != {n} committed")
            hc.lengths[b] = self.valid[b]
            counts.append(c)
            feats.append(torch.cat(self.pending[b]))  # [c, 3 E_t]
            toks.append([int(t) for t in history[b][n - c + 1 : n + 1]])
        T = max(counts)
        f = torch.zeros(B, T, feats[0].shape[-1], dtype=feats[0].dtype, device=dev)  # [B, T, 3 E_t]
        for b in range(B):
            f[b, : counts[b]] = feats[b]
        ids = torch.tensor([t + [t[-1]] * (T - len(t)) for t in toks], dtype=torch.long, device=dev)  # [B, T]
        last = torch.tensor([c - 1 for c in counts], device=dev)
        ar = torch.arange(B, device=dev)
        head = self.head
        state = {}

        def step(tok: torch.Tensor, j: int) -> torch.Tensor:
            if j == 0:
                out = head.forward_cached(ids, head.fuse(f), hc, counts)  # [B, T, E_d]
                h = out[ar, last][:, None]  # [B, 1, E_d]
            else:
                h = head.forward_cached(tok, state["h"], hc)  # [B, 1, E_d]
            state["h"] = h
            return head.target_logits(head.draft_logits(h[:, 0]))  # [B, V]

        for b in range(B):
            self.valid[b] += counts[b]
            self.pending[b] = []
        row_limits = [max(0, int(x)) for x in limits]
        try:
            if max(row_limits, default=0) == 0:  # nothing to draft: still absorb the features
                head.forward_cached(ids, head.fuse(f), hc, counts)
                return empty_draft(pending)
            return draft_loop(step, pending, row_limits, policies, sampling)
        finally:
            self.hcache.lengths[:B] = hc.lengths

    def commit(self, cache: KVCache, rows: torch.Tensor | None, counts: Sequence[int],
               hidden: torch.Tensor | None = None) -> None:
        if hidden is None:
            raise ValueError("eagle3 needs the target's features of the verified positions (want_hidden)")
        for b in range(cache.batch_size):
            self.hcache.lengths[b] = self.valid[b]  # forget the draft steps' pairs
            self.pending[b].append(hidden[b, : int(counts[b])])
            if self.valid[b] + self._npending(b) != cache.lengths[b]:
                raise RuntimeError(f"eagle3 slot {b}: {self.valid[b]} pairs + {self._npending(b)} pending features "
                                   f"!= {cache.lengths[b]} committed")

    def move(self, src: int, dst: int) -> None:
        self.hcache.move(src, dst)
        self.valid[dst] = self.valid[src]
        self.pending[dst] = self.pending[src]
        self.pending[src] = []

    def index_sizes(self) -> list[int]:
        return [0] * len(self.valid)  # no sparse index: the head attends to its whole cache

    @property
    def nbytes(self) -> int:
        return self.hcache.nbytes

