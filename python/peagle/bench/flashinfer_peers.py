"""FlashInfer as a peer in ``peagle bench ops attention`` and ``verify`` (issue 21).

FlashInfer is optional: :func:`load` returns ``(None, reason)`` when it cannot be imported (or
there is no CUDA device), and the benchmarks then record the reason and time no peer. A
backend that fails (raises at plan, load or run, e.g. one that does not serve SM90) is recorded
with its error instead of a time. Rows are named ``flashinfer-<backend>``.

Attention (q_len 14 per request over the paged cache of
:class:`peagle.bench.paged_attention.Case`, bottom-right causal, bf16, NHD pages of 16):

* ``flashinfer-fa2`` / ``flashinfer-fa3``: ``BatchPrefillWithPagedKVCacheWrapper(backend=...)``;
* ``flashinfer-decode-fa2``: ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)``
  planned with ``q_len_per_req=14``; ``-cg``: the same with ``use_cuda_graph=True`` (the
  planner a graph-captured engine must use); ``flashinfer-decode-fa3``: fa3 (0.7.4 raises
  NotImplementedError for ``q_len_per_req > 1``; recorded);
* ``flashinfer-xqa``: ``xqa_batch_decode_with_kv_cache(q_len_per_req=14)`` with a causal mask
  over the 14 draft rows (bit-packed as ``flashinfer.decode._make_xqa_mtp_causal_mask``);
* ``flashinfer-batch-attention``: the persistent ``BatchAttention`` (causal).

Every wrapper is planned outside the timed region, one per rotating input set (the sets differ
in their page tables only; the float workspace is shared, as FlashInfer allows); plain plans
(``use_cuda_graph=False``) are then captured in CUDA graphs like every other impl.

Verification (from the bf16 logits of :func:`peagle.bench.verify_chain.make_set`, random modes):

* ``flashinfer-chain``: ``softmax(logits, temperature)`` (per-row temperature, fp32 probs),
  ``top_k_renorm_probs`` + ``top_p_renorm_probs`` when filtered, then
  ``chain_speculative_sampling`` with one-hot draft probabilities (argmax drafts; built outside
  the timed region) -- a whole verification step, bonus token included;
* ``flashinfer-bonus-tktp`` (top-k/top-p cases): ``top_k_top_p_sampling_from_logits`` over the B
  bonus rows (temperature applied first), the sampler vLLM calls for the bonus token.

Their outputs are random, so they are checked by chi-square (:mod:`peagle.bench.stats`): the
first emitted token of every request follows the request's first target row (speculative
sampling preserves the target distribution), the bonus sampler's tokens follow the filtered
bonus rows.
"""

from __future__ import annotations

import math

import torch

Q_LEN = 14
PAGE = 16
WORKSPACE_BYTES = 512 * 1024 * 1024

ATTENTION_BACKENDS = (
    "fa2",
    "fa3",
    "decode-fa2",
    "decode-fa2-cg",
    "decode-fa3",
    "xqa",
    "batch-attention",
)


def load():
    """(flashinfer module, None) or (None, why it is not measured)."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001  (any import failure: the peer is skipped)
        return None, f"flashinfer not importable: {type(e).__name__}: {e}"
    return flashinfer, None


def version(fi) -> str:
    return getattr(fi, "__version__", "unknown")


def short_error(e: BaseException, limit: int = 300) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:limit]}"


def xqa_causal_mask(batch: int, q_len: int, device="cpu") -> torch.Tensor:
    """The XQA speculative-decoding mask: [batch, q_len, 2 * ceil(q_len / 32)] uint16 (32-bit
    words viewed as uint16 pairs), row i of each request with bits j <= i set: bit j % 32 of
    word j // 32 (the draft rows are the last q_len keys; everything before them is visible)."""
    words = (q_len + 31) // 32
    i = torch.arange(q_len).view(q_len, 1)
    j = torch.arange(words * 32).view(1, words * 32)
    bits = (j <= i).view(q_len, words, 32).to(torch.int64)
    packed = (bits << torch.arange(32)).sum(-1)  # [q_len, words], values < 2**32
    mask = packed.to(torch.uint32).unsqueeze(0).expand(batch, q_len, words).contiguous()
    return mask.view(torch.uint16).to(device)


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


class AttentionPeers:
    """The FlashInfer attention backends for one benchmark case; ``fns`` maps impl -> fn(i),
    ``errors`` impl -> the error of a backend that could not be set up."""

    def __init__(self, fi, c, n_sets: int, backends=ATTENTION_BACKENDS):
        self.fi, self.c, self.n = fi, c, n_sets
        dev = c.device
        b = c.b
        self.blocks = -(-c.kv // PAGE)
        i32 = {"device": dev, "dtype": torch.int32}
        self.qo_indptr = c.qsl
        self.kv_indptr = torch.arange(b + 1, **i32) * self.blocks
        self.last_page_len = torch.full((b,), c.kv - (self.blocks - 1) * PAGE, **i32)
        self.kv_len = torch.full((b,), c.kv, **i32)
        self.indices = [c.tables[s].reshape(-1).contiguous() for s in range(n_sets)]
        self.kv_cache = (c.key_cache, c.value_cache)
        self.outs = [torch.empty_like(q) for q in c.queries[:n_sets]]
        self._workspaces: dict[str, torch.Tensor] = {}
        self.fns, self.errors = {}, {}
        for backend in backends:
            impl = f"flashinfer-{backend}"
            try:
                self.fns[impl] = getattr(self, "_" + backend.replace("-", "_"))()
            except Exception as e:  # noqa: BLE001  (recorded, not fatal)
                self.errors[impl] = short_error(e)
            if torch.device(dev).type == "cuda":
                torch.cuda.synchronize()

    def workspace(self, key: str) -> torch.Tensor:
        if key not in self._workspaces:  # zeroed: XQA's semaphores and fa2 expect it
            self._workspaces[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8,
                                                device=self.c.device)  # fmt: skip
        return self._workspaces[key]

    def _plan_kwargs(self):
        bf16 = torch.bfloat16
        return {"q_data_type": bf16, "kv_data_type": bf16, "o_data_type": bf16}

    def _prefill(self, backend: str):
        c, fi = self.c, self.fi
        ws = self.workspace("prefill-" + backend)
        wrappers = []
        for s in range(self.n):
            w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
            w.plan(self.qo_indptr, self.kv_indptr, self.indices[s], self.last_page_len,
                   c.hq, c.hkv, c.d, PAGE, causal=True, sm_scale=c.scale,
                   **self._plan_kwargs())  # fmt: skip
            wrappers.append(w)

        def run(i):
            s = i % self.n
            return wrappers[s].run(c.queries[s], self.kv_cache, out=self.outs[s])

        return run

    def _fa2(self):
        return self._prefill("fa2")

    def _fa3(self):
        return self._prefill("fa3")

    def _decode(self, backend: str, graph: bool):
        c, fi = self.c, self.fi
        ws = self.workspace(f"decode-{backend}-{graph}")
        wrappers = []
        for s in range(self.n):
            kw = {}
            if graph:
                kw = {
                    "use_cuda_graph": True,
                    "paged_kv_indptr_buffer": self.kv_indptr.clone(),
                    "paged_kv_indices_buffer": self.indices[s].clone(),
                    "paged_kv_last_page_len_buffer": self.last_page_len.clone(),
                }
            w = fi.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_tensor_cores=True, backend=backend, **kw
            )
            w.plan(self.kv_indptr, self.indices[s], self.last_page_len, c.hq, c.hkv, c.d, PAGE,
                   sm_scale=c.scale, q_len_per_req=Q_LEN, **self._plan_kwargs())  # fmt: skip
            wrappers.append(w)

        def run(i):
            s = i % self.n
            return wrappers[s].run(c.queries[s], self.kv_cache, out=self.outs[s])

        return run

    def _decode_fa2(self):
        return self._decode("fa2", graph=False)

    def _decode_fa2_cg(self):
        return self._decode("fa2", graph=True)

    def _decode_fa3(self):
        return self._decode("fa3", graph=False)

    def _xqa(self):
        c = self.c
        xqa_batch_decode_with_kv_cache = self.fi.decode.xqa_batch_decode_with_kv_cache
        ws = self.workspace("xqa")
        mask = xqa_causal_mask(c.b, Q_LEN, c.device)
        tables = [c.tables[s].contiguous() for s in range(self.n)]

        def run(i):
            s = i % self.n
            return xqa_batch_decode_with_kv_cache(
                c.queries[s], self.kv_cache, ws, tables[s], self.kv_len, c.kv,
                bmm1_scale=c.scale, bmm2_scale=1.0, out=self.outs[s], q_len_per_req=Q_LEN,
                mask=mask,
            )  # fmt: skip

        return run

    def _batch_attention(self):
        c, fi = self.c, self.fi
        ws = self.workspace("batch-attention")
        wrappers = []
        lses = [torch.empty(c.b * Q_LEN, c.hq, device=c.device) for _ in range(self.n)]
        for s in range(self.n):
            w = fi.BatchAttention("NHD", device=c.device)
            w.float_workspace_buffer = ws  # shared (384 MB each otherwise)
            w.plan(self.qo_indptr, self.kv_indptr, self.indices[s], self.kv_len, c.hq, c.hkv,
                   c.d, c.d, PAGE, causal=True, sm_scale=c.scale, q_data_type=torch.bfloat16,
                   kv_data_type=torch.bfloat16)  # fmt: skip
            wrappers.append(w)

        def run(i):
            s = i % self.n
            out, _ = wrappers[s].run(c.queries[s], self.kv_cache, out=self.outs[s], lse=lses[s])
            return out

        return run


# ---------------------------------------------------------------------------------------------
# verification
# ---------------------------------------------------------------------------------------------


class VerifyPeer:
    """FlashInfer's verification path for one random case over the sets of
    :func:`peagle.bench.verify_chain.make_set` (drafts: argmax-style, one-hot q)."""

    def __init__(self, fi, sets: list[dict], k: int, temp: float, top):
        self.fi, self.sets, self.k, self.temp, self.top = fi, sets, k, temp, top
        s0 = sets[0]
        rows, self.v = s0["logits"].shape
        self.b = rows // (k + 1)
        dev = s0["logits"].device
        self.temp_rows = torch.full((rows,), temp, device=dev)
        self.drafts = [s["drafts"].view(self.b, k).contiguous() for s in sets]
        self.draft_probs = []
        for d in self.drafts:  # one-hot q at the drafted token
            q = torch.zeros(self.b, k, self.v, device=dev)
            q.scatter_(2, d.long().unsqueeze(-1), 1.0)
            self.draft_probs.append(q)
        if top is not None:
            self.top_k_rows = torch.full((rows,), top[0], device=dev, dtype=torch.int32)
            self.top_p_rows = torch.full((rows,), top[1], device=dev)
            self.top_k_b = torch.full((self.b,), top[0], device=dev, dtype=torch.int32)
            self.top_p_b = torch.full((self.b,), top[1], device=dev)
        self.bonus_rows = torch.arange(self.b, device=dev) * (k + 1) + k
        self.seed = torch.tensor([1234], device=dev, dtype=torch.int64)
        self.offset = torch.zeros(1, device=dev, dtype=torch.int64)
        self.acc = torch.zeros(self.b, device=dev, dtype=torch.int32)
        self.emitted = torch.zeros(self.b, device=dev, dtype=torch.int32)

    def target(self, s: int) -> torch.Tensor:
        """[B, K+1, V] fp32 target probabilities through FlashInfer's kernels."""
        sp = self.fi.sampling
        probs = sp.softmax(self.sets[s]["logits"], temperature=self.temp_rows)
        if self.top is not None:
            probs = sp.top_k_renorm_probs(probs, self.top_k_rows)
            probs = sp.top_p_renorm_probs(probs, self.top_p_rows)
        return probs.view(self.b, self.k + 1, self.v)

    def chain(self, i: int, seed=None, offset=None):
        s = i % len(self.sets)
        self.acc.zero_()  # the kernel adds into its counters (EDGE_CASES G6)
        self.emitted.zero_()
        out, _, emitted = self.fi.sampling.chain_speculative_sampling(
            self.draft_probs[s], self.drafts[s], self.target(s), self.acc, self.emitted,
            seed=self.seed if seed is None else seed,
            offset=self.offset if offset is None else offset,
        )  # fmt: skip
        return out, emitted

    def bonus(self, i: int, seed=None, offset=None):
        s = i % len(self.sets)
        logits = self.sets[s]["logits"][self.bonus_rows].float() / self.temp
        return self.fi.sampling.top_k_top_p_sampling_from_logits(
            logits, self.top_k_b, self.top_p_b, top_k_max=self.top[0],
            seed=self.seed if seed is None else seed,
            offset=self.offset if offset is None else offset,
        )  # fmt: skip

    # -- statistical checks (before timing) ------------------------------------------------

    def _draws(self, fn, n_samples: int):
        dev = self.seed.device
        reps = max(1, math.ceil(n_samples / self.b))
        outs = []
        for r in range(reps):
            seed = torch.tensor([1000 + r], device=dev, dtype=torch.int64)
            outs.append(fn(0, seed=seed, offset=torch.zeros(1, device=dev, dtype=torch.int64)))
        return reps, outs

    def check_chain(self, n_samples: int = 4096):
        """Chi-square of the first emitted token against target row 0 of each request."""
        from peagle.bench.stats import chi_square_pit, target_probs

        reps, outs = self._draws(lambda i, **kw: self.chain(i, **kw)[0][:, 0].clone(), n_samples)
        top_k, top_p = self.top if self.top is not None else (None, None)
        rows = self.sets[0]["logits"].view(self.b, self.k + 1, self.v)[:, 0]
        p = target_probs(rows, self.temp, top_k, top_p)
        rows_of = torch.arange(self.b).repeat(reps)
        return chi_square_pit(torch.cat(outs), p, rows=rows_of,
                              generator=torch.Generator().manual_seed(0))  # fmt: skip

    def check_bonus(self, n_samples: int = 4096):
        from peagle.bench.stats import chi_square_pit, target_probs

        reps, outs = self._draws(self.bonus, n_samples)
        rows = self.sets[0]["logits"][self.bonus_rows]
        p = target_probs(rows, self.temp, self.top[0], self.top[1])
        rows_of = torch.arange(self.b).repeat(reps)
        return chi_square_pit(torch.cat(outs), p, rows=rows_of,
                              generator=torch.Generator().manual_seed(0))  # fmt: skip
