"""The speculative decode loop on CPU (float32) with tiny clear-margin models.

Greedy references come from transformers' own ``generate`` on the same model; before comparing,
each test checks that the reference's top-1/top-2 logit margins are far above float32 noise, so an
exact token-for-token comparison is meaningful (a mismatch is a bug, not a near-tie).
"""

from __future__ import annotations

import pytest
import torch
from reference.drafter import drafter_forward_ref
from tiny_models import VOCAB, make_drafter, make_target

import peagle.models.paged as paged
from peagle.decode import SamplingParams, SpecDecoder
from peagle.models import TargetRunner

PROMPTS = [[5], [11, 3, 60], [42, 17, 8, 90, 33, 2, 71], [9, 9, 9, 4, 4, 4, 66, 2, 2, 13, 58, 7]]
N = 20
MIN_MARGIN = 1e-3  # float32 logits of these models are accurate to ~1e-5


@pytest.fixture(scope="module")
def llama():
    model, g = make_target("llama")
    return model, g, TargetRunner(model)


def hf_greedy(model, prompt, n=N):
    x = torch.tensor([prompt])
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=n,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    top2 = torch.stack([step[0].topk(2).values for step in out.logits])
    assert float((top2[:, 0] - top2[:, 1]).min()) > MIN_MARGIN, "reference has a near-tie"
    return out.sequences[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def llama_refs(llama):
    model = llama[0]
    return [hf_greedy(model, p) for p in PROMPTS]


def engine(runner, model, g, method, k, **kw):
    drafter = None if method == "none" else make_drafter(model, g, parallel=method == "peagle")
    kw.setdefault("block_size", 4)  # small blocks: many block boundaries
    return SpecDecoder(runner, drafter, method=method, num_speculative_tokens=k, **kw)


# ---------------------------------------------------------------------------------------------
# Greedy equivalence
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,k",
    [("none", 1), ("peagle", 1), ("peagle", 2), ("peagle", 4), ("eagle3", 1), ("eagle3", 3)],
)
def test_greedy_equivalence(llama, llama_refs, method, k):
    model, g, runner = llama
    eng = engine(runner, model, g, method, k)
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=N))
    for out, ref in zip(outs, llama_refs, strict=True):
        assert out.token_ids == ref
        assert out.finish_reason == "length"
        st = out.stats
        assert 1.0 <= st.acceptance_length <= k + 1
        assert st.num_generated_tokens == N and st.tokens_per_second > 0
    if method != "none":
        drafted = sum(o.stats.num_draft_tokens for o in outs)
        accepted = sum(o.stats.num_accepted_tokens for o in outs)
        assert 0 < accepted < drafted  # both acceptance and rejection paths ran
        assert all(o.stats.drafter_time_s > 0 for o in outs)
        assert all(len(o.stats.per_position_acceptance) == k for o in outs)
    assert eng.allocator.num_allocated == 0


@pytest.mark.parametrize("method,k", [("peagle", 3), ("eagle3", 2)])
def test_greedy_equivalence_qwen3(method, k):
    model, g = make_target("qwen3", seed=1)
    refs = [hf_greedy(model, p) for p in PROMPTS]
    eng = engine(TargetRunner(model), model, g, method, k)
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=N))
    assert [o.token_ids for o in outs] == refs


@pytest.mark.parametrize("method,k", [("none", 1), ("peagle", 3), ("eagle3", 2)])
def test_greedy_equivalence_graph_layout(llama, llama_refs, method, k):
    """The CUDA-graph path's padded static-buffer layout (3 requests padded to 4), run eagerly."""
    model, g, runner = llama
    eng = engine(runner, model, g, method, k, cuda_graphs="emulate", max_num_seqs=4)
    outs = eng.generate(PROMPTS[1:], SamplingParams(max_new_tokens=N))
    assert [o.token_ids for o in outs] == llama_refs[1:]
    assert 4 in eng.graphs.graphs  # the padded size was used


def test_full_acceptance():
    """A target and drafter that always pick one token: every draft is accepted."""
    c = 17
    model, g = make_target(constant_token=c)
    d = make_drafter(model, g, constant_token=c)
    eng = SpecDecoder(
        TargetRunner(model), d, method="peagle", num_speculative_tokens=4, block_size=4
    )
    out = eng.generate([[3, 4, 5]], SamplingParams(max_new_tokens=21))[0]
    assert out.token_ids == hf_greedy(model, [3, 4, 5], 21) == [c] * 21
    # prefill emits 1 token, then 4 steps of 4 drafts + bonus
    assert out.stats.num_spec_steps == 4 and out.stats.acceptance_length == 5.0
    assert out.stats.per_position_acceptance == [1.0] * 4


# ---------------------------------------------------------------------------------------------
# Batches, sampling, joins
# ---------------------------------------------------------------------------------------------


def test_batch_independence(llama):
    model, g, runner = llama
    greedy = SamplingParams(max_new_tokens=15)
    seeded = SamplingParams(max_new_tokens=15, temperature=0.9, seed=1234)
    eng = engine(runner, model, g, "peagle", 3)
    alone = [eng.generate([PROMPTS[2]], p)[0].token_ids for p in (greedy, seeded)]
    neighbours = [
        (PROMPTS[0], SamplingParams(max_new_tokens=7, temperature=1.0, seed=7)),
        (PROMPTS[3], SamplingParams(max_new_tokens=25, num_speculative_tokens=1)),
        (PROMPTS[1], SamplingParams(max_new_tokens=3)),
    ]
    for params, expect in zip((greedy, seeded), alone, strict=True):
        batch = [p for p, _ in neighbours[:2]] + [PROMPTS[2]] + [neighbours[2][0]]
        ps = [sp for _, sp in neighbours[:2]] + [params] + [neighbours[2][1]]
        outs = eng.generate(batch, ps)
        assert outs[2].token_ids == expect


def test_seeded_sampling_reproducible(llama):
    model, g, runner = llama
    runs = []
    for seed in (11, 11, 12):
        eng = engine(runner, model, g, "peagle", 3)
        ps = [SamplingParams(max_new_tokens=N, temperature=1.0, seed=seed + i) for i in range(4)]
        runs.append([o.token_ids for o in eng.generate(PROMPTS, ps)])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_requests_join_and_finish_independently(llama, llama_refs):
    model, g, runner = llama
    eng = engine(runner, model, g, "peagle", 3, max_num_seqs=3)
    done = {}
    ids = [eng.add_request(PROMPTS[0], SamplingParams(max_new_tokens=N))]
    ids.append(eng.add_request(PROMPTS[1], SamplingParams(max_new_tokens=5)))
    for _ in range(3):
        done.update({o.request_id: o for o in eng.step()})
    ids.append(eng.add_request(PROMPTS[2], SamplingParams(max_new_tokens=N)))
    ids.append(
        eng.add_request(PROMPTS[3], SamplingParams(max_new_tokens=N, num_speculative_tokens=1))
    )
    assert len(eng.running) <= 3
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step()})
    expect = [llama_refs[0], llama_refs[1][:5], llama_refs[2], llama_refs[3]]
    assert [done[i].token_ids for i in ids] == expect
    assert eng.allocator.num_allocated == 0


@pytest.mark.parametrize("method", ["peagle", "eagle3", "none"])
def test_max_num_batched_tokens_admits_prompts_within_the_step_budget(llama, llama_refs, method):
    """Prompts are admitted in order while the step's rows (decode rows + admitted prompts) fit
    the budget; the step's first prompt is admitted regardless (no chunked prefill). Outputs
    are those of the unbudgeted engine."""
    model, g, runner = llama
    budget = 10  # prompts of 1, 3, 7 and 12 tokens
    eng = engine(runner, model, g, method, 3, max_num_seqs=4, max_num_batched_tokens=budget)
    steps = []
    orig = eng.scheduler.schedule

    def spy():
        waiting = [len(r.prompt_token_ids) for r in eng.scheduler.waiting]
        s = orig()
        if s is not None:
            new = [s.qlens[i] for i in s.prefills]
            decode = sum(q for i, q in enumerate(s.qlens) if i not in s.prefills)
            steps.append((decode, new, waiting[len(new) : len(new) + 1]))
        return s

    eng.scheduler.schedule = spy
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=N))
    assert [o.token_ids for o in outs] == llama_refs
    admitting = [st for st in steps if st[1]]
    assert [len(st[1]) for st in admitting] == [2, 1, 1]  # 1+3 | 7 (first) | 12 (first)
    for decode, new, nxt in steps:
        if len(new) > 1:
            assert decode + sum(new) <= budget
        if new and nxt:  # the next waiting prompt did not fit
            assert decode + sum(new) + nxt[0] > budget
    assert eng.allocator.num_allocated == 0
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine(runner, model, g, method, 3, max_num_batched_tokens=0)


# ---------------------------------------------------------------------------------------------
# Stop conditions and budgets
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_stop_tokens(llama, llama_refs, method):
    model, g, runner = llama
    ref = llama_refs[2]
    stop = ref[6]
    j = ref.index(stop)
    eng = engine(runner, model, g, method, 4, eos_token_ids=[stop])
    out = eng.generate([PROMPTS[2]], SamplingParams(max_new_tokens=N))[0]
    assert out.token_ids == ref[: j + 1] and out.finish_reason == "stop"
    out = eng.generate([PROMPTS[2]], SamplingParams(max_new_tokens=N, ignore_eos=True))[0]
    assert out.token_ids == ref
    eng = engine(runner, model, g, method, 4)
    params = SamplingParams(max_new_tokens=N, stop_token_ids=[ref[9], stop])
    out = eng.generate([PROMPTS[2]], params)[0]
    assert out.token_ids == ref[: min(j, ref.index(ref[9])) + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("max_new", [1, 2, 3, 7])
def test_max_new_tokens_caps_emitted_and_counted_drafts(llama, llama_refs, max_new):
    """EDGE_CASES E2: nothing is emitted past the budget, and the statistics count only drafts
    within the remaining budget minus the bonus token (K drafts are still verified)."""
    model, g, runner = llama
    eng = engine(runner, model, g, "peagle", 4)
    out = eng.generate([PROMPTS[3]], SamplingParams(max_new_tokens=max_new))[0]
    assert out.token_ids == llama_refs[3][:max_new] and out.finish_reason == "length"
    st = out.stats
    assert st.num_steps - 1 + st.num_accepted_tokens == max_new - 1  # every step emits a+1
    assert st.num_draft_tokens <= max(max_new - 2, 0) * 4
    assert all(
        a <= d for a, d in zip(st.accepted_per_position, st.drafted_per_position, strict=True)
    )


@pytest.mark.parametrize("tight", [False, True])
@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_steps_near_the_budget_stay_graph_uniform(llama, llama_refs, method, tight):
    """The last steps before ``max_new_tokens`` (and, ``tight``, before a ``max_model_len`` of
    exactly the longest prompt + budget, as ``bench e2e`` sets it) carry all K drafts, so with
    staggered budgets every decode step replays a CUDA graph (here: the emulated graph layout)
    instead of falling back to the eager path; outputs stay the target's greedy tokens."""
    model, g, runner = llama
    mml = max(len(p) for p in PROMPTS) + N if tight else None
    eng = engine(
        runner, model, g, method, 4, cuda_graphs="emulate", max_num_seqs=4, max_model_len=mml
    )
    budgets = [N, N - 3, N - 6, 5]
    params = [SamplingParams(max_new_tokens=n) for n in budgets]
    outs = eng.generate([PROMPTS[i] for i in range(4)], params)
    for i, (o, n) in enumerate(zip(outs, budgets, strict=True)):
        assert o.token_ids == llama_refs[i][:n] and o.finish_reason == "length"
    assert eng.num_steps > 1 and eng.num_graph_steps == eng.num_steps - 1  # all but the prefill


def test_max_model_len(llama, llama_refs):
    model, g, runner = llama
    prompt = PROMPTS[2]
    eng = engine(runner, model, g, "peagle", 4, max_model_len=len(prompt) + 6)
    out = eng.generate([prompt], SamplingParams(max_new_tokens=N))[0]
    assert out.token_ids == llama_refs[2][:6] and out.finish_reason == "length"


def test_drafter_position_limit(llama, llama_refs):
    """EDGE_CASES C6: a drafter trained for shorter contexts stops drafting at its limit; the
    output is still the target's."""
    model, g, runner = llama
    d = make_drafter(model, g, max_position_embeddings=14)
    eng = SpecDecoder(runner, d, method="peagle", num_speculative_tokens=3, block_size=4)
    out = eng.generate([PROMPTS[2]], SamplingParams(max_new_tokens=N))[0]
    assert out.token_ids == llama_refs[2]
    assert out.stats.num_spec_steps < out.stats.num_steps - 1  # later steps had no drafts


# ---------------------------------------------------------------------------------------------
# Drafts vs a dense reference drafter (EDGE_CASES C3, C7, F1)
# ---------------------------------------------------------------------------------------------


def reference_drafts(model, runner, d, tokens, k, method):
    """Drafts for the next step of a request holding ``tokens``, recomputed from scratch: dense
    float64 drafter over rows ``(t[p+1], fc(features(p)))`` for p < L-1, then K-1 mask rows
    (peagle) or K-1 serial rows fed with the previous pre-norm output (eagle3). Returns the draft
    ids and each draft's top-1/top-2 logit margin."""
    n = len(tokens)
    with torch.no_grad():
        hs = model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        fch = d.fc(torch.cat([hs[i][0] for i in runner.aux_layer_ids], -1))
        sd, cfg = d.state_dict(), d.config.to_dict()
        ids, hid = torch.tensor(tokens[1:]), fch
        if method == "peagle":
            ids = torch.cat([ids, torch.full((k - 1,), d.config.mask_token_id)])
            hid = torch.cat([hid, d.mask_vector().expand(k - 1, -1)])
            normed, _, drafts = drafter_forward_ref(sd, cfg, ids, hid, torch.arange(n + k - 2))
            normed, drafts = normed[n - 2 :], drafts[n - 2 :]
        else:
            rows_n, rows_d = [], []
            for _ in range(k):
                normed, prenorm, drafts = drafter_forward_ref(
                    sd, cfg, ids, hid, torch.arange(ids.shape[0])
                )
                rows_n.append(normed[-1])
                rows_d.append(drafts[-1])
                ids = torch.cat([ids, drafts[-1:]])
                hid = torch.cat([hid, prenorm[-1:].float()])
            normed, drafts = torch.stack(rows_n), torch.stack(rows_d)
        top2 = (normed @ sd["lm_head.weight"].double().T).topk(2).values
    return drafts.tolist(), (top2[:, 0] - top2[:, 1]).tolist()


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_drafts_match_dense_reference(llama, method):
    """Every step's drafts equal a from-scratch dense drafter over the accepted history: the
    drafter batch layout, the mask rows, rejected rows (never written, never attended) and the
    drafter's KV bookkeeping across steps are all exactly right."""
    model, g, runner = llama
    k = 3
    eng = engine(runner, model, g, method, k)
    for p in PROMPTS[1:3]:
        eng.add_request(p, SamplingParams(max_new_tokens=N))
    checked = 0
    while eng.has_unfinished():
        eng.step()
        for r in eng.running:
            if r.draft_row is None:
                continue
            got = eng._last_drafts[r.draft_row].tolist()
            tokens = r.prompt_token_ids + r.output_token_ids
            ref, margins = reference_drafts(model, runner, eng.drafter, tokens, k, method)
            for j in range(k):
                if margins[j] > MIN_MARGIN:
                    assert got[j] == ref[j], (r.request_id, len(tokens), j, got, ref)
                    checked += 1
    assert checked > 20


# ---------------------------------------------------------------------------------------------
# KV block accounting (EDGE_CASES C7)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_blocks_allocated_equal_written(llama, method, monkeypatch):
    model, g, runner = llama
    eng = engine(runner, model, g, method, 3)
    written: set[int] = set()
    real_write = paged.ops.write_kv_cache

    def spy(key, value, key_cache, value_cache, slot_mapping):
        held = {b for r in eng.running for b in r.blocks}
        blocks = {int(s) // eng.block_size for s in slot_mapping.tolist() if s >= 0}
        assert 0 not in blocks, "wrote the null block"
        assert blocks <= held, f"wrote blocks {blocks - held} that no running request holds"
        written.update(blocks)
        real_write(key, value, key_cache, value_cache, slot_mapping)

    monkeypatch.setattr(paged.ops, "write_kv_cache", spy)
    for p in PROMPTS:
        eng.add_request(p, SamplingParams(max_new_tokens=N))
    while eng.has_unfinished():
        eng.step()
        held = {b for r in eng.running for b in r.blocks}
        assert held <= written, f"blocks {held - written} allocated but never written"
        assert eng.allocator.num_allocated == len(held)
    assert eng.allocator.num_allocated == 0
    assert eng.allocator.num_free == eng.allocator.num_blocks - 1


# ---------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------


def test_bad_inputs(llama):
    model, g, runner = llama
    eng = engine(runner, model, g, "peagle", 3, max_model_len=32)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.add_request([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request([1, VOCAB])
    with pytest.raises(ValueError, match="max_model_len=32"):
        eng.add_request(list(range(32)))
    with pytest.raises(ValueError, match="at most 3"):
        eng.add_request([1], SamplingParams(num_speculative_tokens=4))
    with pytest.raises(ValueError, match="stop token id"):
        eng.add_request([1], SamplingParams(stop_token_ids=[-1]))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="method"):
        SpecDecoder(runner, None, method="medusa")
    with pytest.raises(ValueError, match="needs a drafter"):
        SpecDecoder(runner, None, method="peagle")
    with pytest.raises(ValueError, match="mask_hidden"):
        SpecDecoder(runner, make_drafter(model, g, parallel=False), method="peagle")
    with pytest.raises(ValueError, match=">= 1"):
        SpecDecoder(runner, make_drafter(model, g), method="peagle", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="share device and dtype"):
        SpecDecoder(runner, make_drafter(model, g).to(torch.float64), method="peagle")
    with pytest.raises(ValueError, match="needs a CUDA target"):
        SpecDecoder(runner, None, method="none", cuda_graphs="on")
    small = SpecDecoder(runner, None, method="none", num_blocks=3, block_size=4)
    small.add_request([1, 2, 3], SamplingParams(max_new_tokens=20))
    with pytest.raises(RuntimeError, match="KV blocks"):
        small.step()
