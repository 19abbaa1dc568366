"""Paged KV caches: the same attention as contiguous caches, copy-on-write forks, dense round trips, all or
nothing page reservation."""

import pytest
import torch

from wkvm.engine.kv_pages import OutOfPages, PagedKV, PagePool, SeqKV
from wkvm.models.kv import DenseKV, key_name, value_name
from wkvm.models.spec import StateSpec, TensorSpec

H_KV, D, H_Q = 2, 6, 4
SPEC = StateSpec("test", tuple(TensorSpec(f"layers.{i}.{x}", (H_KV, D), kind="kv") for i in (0, 1) for x in "kv"))


def dense_state(batch: int) -> dict[str, torch.Tensor]:
    return {t.name: torch.zeros(batch, 0, H_KV, D) for t in SPEC.tensors}


def feed(kv, layer: int, gen: torch.Generator, batch: int, n: int) -> torch.Tensor:
    """Append n random tokens' keys/values to `layer` and attend with random queries."""
    k, v = torch.randn(batch, n, H_KV, D, generator=gen), torch.randn(batch, n, H_KV, D, generator=gen)
    q = torch.randn(batch, n, H_Q, D, generator=gen)
    kv.append(layer, k, v)
    return kv.attend(layer, q, D**-0.5)


@pytest.mark.parametrize("page", [1, 3, 16])
def test_paged_attention_equals_dense(page):
    """Chunks of 5, 1, 7 and 1 tokens for 2 rows and 2 layers: every output equals the contiguous cache's."""
    pool = PagePool(SPEC, n_pages=64, page_tokens=page)
    seqs = [SeqKV(), SeqKV()]
    state = dense_state(2)
    for n in (5, 1, 7, 1):
        for s in seqs:
            s.reserve(pool, n)
        paged, dense = PagedKV(pool, seqs, n), DenseKV(state, [0, 1])
        assert paged.positions().tolist() == dense.positions().tolist()
        for layer in (0, 1):
            a = feed(paged, layer, torch.Generator().manual_seed(n * 10 + layer), 2, n)
            b = feed(dense, layer, torch.Generator().manual_seed(n * 10 + layer), 2, n)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        paged.commit()
    for i, s in enumerate(seqs):
        got = s.to_dense(pool)
        for name in got:
            torch.testing.assert_close(got[name], state[name][i])


def test_rows_of_different_lengths_attend_only_to_their_own_tokens():
    pool = PagePool(SPEC, n_pages=32, page_tokens=4)
    short, long = SeqKV(), SeqKV()
    for s, n in ((short, 2), (long, 9)):  # fill each alone first
        s.reserve(pool, n)
        kv = PagedKV(pool, [s], n)
        feed(kv, 0, torch.Generator().manual_seed(n), 1, n)
        kv.commit()
    alone = []
    for s in (short, long):
        twin = s.fork(pool)
        twin.reserve(pool, 3)
        alone.append(feed(PagedKV(pool, [twin], 3), 0, torch.Generator().manual_seed(99), 1, 3))
        twin.free(pool)
    for s in (short, long):
        s.reserve(pool, 3)
    gen = torch.Generator().manual_seed(99)
    k, v, q = (torch.randn(1, 3, h, D, generator=gen) for h in (H_KV, H_KV, H_Q))
    both = PagedKV(pool, [short, long], 3)
    both.append(0, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))
    out = both.attend(0, q.expand(2, -1, -1, -1), D**-0.5)
    torch.testing.assert_close(out[0:1], alone[0])
    torch.testing.assert_close(out[1:2], alone[1])


def test_fork_copies_only_the_shared_partial_page_on_append():
    pool = PagePool(SPEC, n_pages=16, page_tokens=4)
    a = SeqKV()
    a.reserve(pool, 10)  # pages: 4 + 4 + 2 (the last partially filled)
    kv = PagedKV(pool, [a], 10)
    for layer in (0, 1):  # every layer, as a forward does: the pool is uninitialised memory until written
        feed(kv, layer, torch.Generator().manual_seed(layer), 1, 10)
    kv.commit()
    before = a.to_dense(pool)
    free = pool.num_free
    b = a.fork(pool)
    assert pool.num_free == free and b.pages == a.pages  # a fork copies nothing
    b.reserve(pool, 1)
    assert b.pages[:2] == a.pages[:2] and b.pages[2] != a.pages[2] and pool.num_free == free - 1
    kv = PagedKV(pool, [b], 1)
    for layer in (0, 1):
        feed(kv, layer, torch.Generator().manual_seed(5 + layer), 1, 1)
    kv.commit()
    after = a.to_dense(pool)
    assert all(torch.equal(before[n], after[n]) for n in before)  # the source never sees the fork's token
    assert torch.equal(b.to_dense(pool)[key_name(0)][:10], before[key_name(0)])
    b.free(pool)
    a.free(pool)
    assert pool.num_free == 16 and not any(pool.refs)


def test_a_fork_leaves_pages_reserved_past_the_length_unshared():
    """A step that raised commits nothing, so its pages stay reserved past the length (full pages here: no partial
    last page for `reserve` to copy). Shared by a fork, both sides appended into the same slots."""
    pool = PagePool(SPEC, n_pages=8, page_tokens=4)
    a = SeqKV()
    a.reserve(pool, 4)
    kv = PagedKV(pool, [a], 4)
    for layer in (0, 1):
        feed(kv, layer, torch.Generator().manual_seed(layer), 1, 4)
    kv.commit()
    a.reserve(pool, 1)  # the next step's page, then its forward raises: not committed
    b = a.fork(pool)
    assert len(a.pages) == 2 and b.pages == a.pages[:1] and pool.refs[a.pages[1]] == 1
    ends = {}
    for seq, seed in ((a, 10), (b, 20)):
        seq.reserve(pool, 1)
        kv = PagedKV(pool, [seq], 1)
        for layer in (0, 1):
            ends[seed] = feed(kv, layer, torch.Generator().manual_seed(seed), 1, 1)
        kv.commit()
    a_keys, b_keys = a.to_dense(pool)[key_name(0)], b.to_dense(pool)[key_name(0)]
    assert torch.equal(a_keys[:4], b_keys[:4]) and not torch.equal(a_keys[4], b_keys[4])
    b.free(pool)
    a.free(pool)
    assert pool.num_free == 8 and not any(pool.refs)


def test_a_forks_shared_partial_page_is_copied_even_with_pages_reserved_past_it():
    """`reserve` looked at the table's last page for a shared partial one: with a page reserved past the length (a step
    that raised) the source then appended into the page it shared with its fork."""
    pool = PagePool(SPEC, n_pages=8, page_tokens=4)
    a = SeqKV()
    a.reserve(pool, 6)  # a full page and a partial one
    kv = PagedKV(pool, [a], 6)
    for layer in (0, 1):
        feed(kv, layer, torch.Generator().manual_seed(layer), 1, 6)
    kv.commit()
    a.reserve(pool, 3)  # the next step's page past the length; its forward raises: not committed
    b = a.fork(pool)
    before = b.to_dense(pool)
    a.reserve(pool, 1)
    assert a.pages[1] != b.pages[1] and a.pages[0] == b.pages[0]  # the shared partial page copied for the appender
    kv = PagedKV(pool, [a], 1)
    for layer in (0, 1):
        feed(kv, layer, torch.Generator().manual_seed(9), 1, 1)
    kv.commit()
    assert all(torch.equal(before[n], b.to_dense(pool)[n]) for n in before)
    a.free(pool)
    b.free(pool)
    assert pool.num_free == 8 and not any(pool.refs)


def test_the_arena_shares_a_kept_start_states_pages_until_it_is_let_go():
    from wkvm.engine.arena import SlotArena

    arena = SlotArena(HYBRID, n_slots=3, kv_pages=8, page_tokens=4)
    assert arena.pool is not None
    state = kv_state(6, seed=2)
    assert arena.pages_to_start(state, 1) == 2
    slots = [arena.alloc() for _ in range(3)]
    arena.write(slots[0], state, keep=True)  # 2 pages, held for the next
    assert arena.pool.num_free == 6 and arena.pages_to_start(state, 1) == 1  # only the partial page's copy
    arena.write(slots[1], state, keep=True)
    arena.write(slots[2], state)  # the last: the kept pages go (the slots still share them)
    assert arena.pool.num_free == 6 and not arena._kept
    assert all(torch.equal(arena.read(s)[n], state[n]) for s in slots for n in state)
    for s in slots:
        arena.free(s)
    assert arena.pool.num_free == 8 and not any(arena.pool.refs)
    arena.write(arena.alloc(), state, keep=True)
    arena.let_go(state)  # a waiting choice ended: nothing else will start from it
    assert not arena._kept and arena.pool.num_free == 6


def test_dense_round_trip_and_all_or_nothing_reservation():
    pool = PagePool(SPEC, n_pages=3, page_tokens=4)
    dense = {t.name: torch.randn(7, H_KV, D) for t in SPEC.tensors}
    seq = SeqKV.from_dense(pool, dense)
    assert seq.length == 7 and len(seq.pages) == 2
    assert all(torch.equal(seq.to_dense(pool)[n], dense[n]) for n in dense)
    with pytest.raises(OutOfPages):
        seq.reserve(pool, 6)  # needs 2 more pages, 1 free
    assert pool.num_free == 1 and len(seq.pages) == 2  # nothing taken
    seq.reserve(pool, 5)
    assert pool.num_free == 0
    assert value_name(1) in seq.to_dense(pool)


def test_pages_go_out_lowest_first_so_a_sequence_reads_its_cache_forwards():
    """A freed sequence's pages go to the next one in ascending order (a stack had handed them out backwards to every
    other request, and its decode read keys and values from high addresses to low: slower by a fifth at 8k tokens)."""
    pool = PagePool(SPEC, n_pages=8, page_tokens=4)
    first, second = SeqKV(), SeqKV()
    first.reserve(pool, 12)
    second.reserve(pool, 8)
    assert first.pages == [0, 1, 2] and second.pages == [3, 4]
    first.free(pool)
    for seq in (SeqKV(), SeqKV()):
        seq.reserve(pool, 16)
        assert seq.pages == sorted(seq.pages)
        seq.free(pool)
    third = SeqKV()
    third.reserve(pool, 24)
    assert third.pages == [0, 1, 2, 5, 6, 7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dense_copy_reads_scattered_pages_at_every_length_around_a_page_edge(dtype):
    """to_dense copies whole pages as blocks, then the last page's used rows: equal to gathering each token's row."""
    pool = PagePool(SPEC, n_pages=12, page_tokens=4, dtype=dtype)
    for pages in pool.pages.values():
        pages.copy_(torch.randn(pages.shape))
    for n in (0, 1, 3, 4, 5, 8, 9, 15, 16):
        seq = SeqKV()
        seq.reserve(pool, n)
        seq.pages = seq.pages[::-1]  # not in pool order
        seq.length = n
        idx = seq.slots(pool, 0, n)
        got = seq.to_dense(pool)
        for name in pool.pages:
            assert got[name].dtype == torch.float32 and got[name].shape == (n, H_KV, D)
            assert torch.equal(got[name], pool.flat(name)[idx].float()), (n, name)
        seq.free(pool)


# --- kv tensors in stored states: files hold the used tokens only --------------------------------------------------

HYBRID = StateSpec("test", (TensorSpec("layers.0.h", (4,)), *SPEC.tensors))


def kv_state(n_kv: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(1, *t.shape_for(n_kv), generator=gen) for t in HYBRID.tensors}


def test_stored_kv_states_round_trip_through_every_tier_and_export(tmp_path):
    from wkvm.state import statefile
    from wkvm.state.statefile import StateFileError, StateMeta
    from wkvm.state.store import StateStore

    store = StateStore(tmp_path / "s", HYBRID, "fp", vocab_size=100)
    for n in (1, 6, 40):  # a state of n tokens holds n - 1 in its kv tensors (the last token is pending)
        state = kv_state(n - 1, seed=n)
        rec = store.put("a", f"s{n}", state, list(range(n)))
        for tier in ("host", "disk"):
            store.hibernate("a", rec.handle, tier)
            _, back = store.load("a", rec.handle)
            assert all(torch.equal(back[k].cpu(), state[k]) for k in state), (n, tier)
        data = store.export_bytes("a", rec.handle)
        imported = store.import_bytes("b", data)
        assert all(torch.equal(store.load("b", imported.handle)[1][k].cpu(), state[k]) for k in state)
    small, large = (len(store.export_bytes("a", f"s{n}")) for n in (6, 40))
    assert large - small >= 34 * HYBRID.token_nbytes  # a file grows with the context
    wrong = statefile.encode(HYBRID, statefile.unbatch(kv_state(3)), StateMeta("fp", HYBRID.spec_hash, [1, 2]))
    with pytest.raises(StateFileError, match="kv tensors hold 3 tokens; a state of 2 tokens"):
        store.import_bytes("a", wrong)
    with pytest.raises(ValueError, match="expected"):
        store.put("a", "bad", {**kv_state(3), key_name(0): torch.zeros(1, 2, H_KV, D)}, [1, 2, 3, 4])


def test_interpolate_refuses_kv_states(tmp_path):
    from wkvm.state.mutations import MutationError, apply_mutation

    state = kv_state(3)
    with pytest.raises(MutationError, match="cannot be blended") as e:
        apply_mutation("interpolate", HYBRID, state, {"other": "x", "t": 0.5}, lambda h: state)
    assert e.value.param == "rule"  # the rule is what this state cannot take, not its params
    decayed = apply_mutation("decay", HYBRID, state, {"alpha": 0.5}, lambda h: state)
    assert torch.equal(decayed[key_name(0)], state[key_name(0)])  # keys and values are kept
    assert torch.equal(decayed["layers.0.h"], state["layers.0.h"] * 0.5)
    attention_only = kv_state(3)
    attention_only.pop("layers.0.h")
    with pytest.raises(MutationError, match="nothing to decay") as e:  # it returned an unchanged copy as a new version
        apply_mutation("decay", SPEC, attention_only, {"alpha": 0.5}, lambda h: attention_only)
    assert e.value.param == "rule"


# --- the slot arena with kv tensors: fixed parts in slots, kv in pages --------------------------------------------


def test_arena_holds_fixed_state_in_slots_and_kv_in_pages():
    from wkvm.engine.arena import SlotArena

    arena = SlotArena(HYBRID, n_slots=3, kv_pages=8, page_tokens=4)
    assert set(arena.tensors) == {"layers.0.h"}
    a = arena.alloc()
    assert a is not None
    state = kv_state(6, seed=1)
    arena.write(a, state)
    assert all(torch.equal(arena.read(a)[k], state[k]) for k in state)
    assert arena.pool is not None and arena.pool.num_free == 6  # 6 tokens in pages of 4
    b = arena.alloc()
    assert b is not None
    arena.copy(a, b)  # a fork shares the pages
    assert arena.pool.num_free == 6
    arena.reserve(b, 1)  # appending to the shared, partial last page copies it
    assert arena.pool.num_free == 5
    gen = torch.Generator().manual_seed(3)
    k, v, q = (torch.randn(1, 1, h, D, generator=gen) for h in (H_KV, H_KV, H_Q))
    kv = arena.kv_batch([b], 1)
    assert kv is not None
    kv.append(0, k, v)
    got = kv.attend(0, q, D**-0.5)
    kv.commit()
    dense = {n: x.clone() for n, x in state.items() if n != "layers.0.h"}
    ref = DenseKV(dense, [0, 1])
    ref.append(0, k, v)
    torch.testing.assert_close(got, ref.attend(0, q, D**-0.5))
    assert all(torch.equal(arena.read(a)[n], state[n]) for n in state)  # the source is untouched
    assert arena.read(b)[key_name(0)].shape[1] == 7
    arena.free(b)
    arena.free(a)
    assert arena.pool.num_free == 8


def test_arena_write_is_all_or_nothing_when_pages_run_out():
    from wkvm.engine.arena import SlotArena
    from wkvm.engine.kv_pages import OutOfPages

    arena = SlotArena(HYBRID, n_slots=2, kv_pages=2, page_tokens=4)
    a = arena.alloc()
    assert a is not None
    arena.write(a, kv_state(5))
    with pytest.raises(OutOfPages):
        arena.write(a, kv_state(12))  # needs 3 pages
    assert arena.read(a)[key_name(0)].shape[1] == 5  # the old state is still there
    with pytest.raises(ValueError, match="give the KV cache some pages"):
        SlotArena(HYBRID, n_slots=1)


def test_scheduler_parks_for_kv_pages_and_resumes_with_the_cache_intact():
    """Three prompts need 3 pages each of a 7-page pool; each step feeds whole prompts, then one token per request.
    The lowest-ranked request is parked (keys and values to host) when pages run short, resumes later with its
    cache unchanged, and every request ends with exactly its tokens cached."""
    from wkvm.config import EngineConfig
    from wkvm.engine.arena import SlotArena
    from wkvm.engine.request import Request, Status
    from wkvm.engine.scheduler import Scheduler
    from wkvm.sampling_params import SamplingParams

    arena = SlotArena(HYBRID, n_slots=3, kv_pages=7, page_tokens=4)
    sched = Scheduler(EngineConfig(n_slots=3, token_budget=64, prefill_chunk=64), arena)
    reqs = [Request(f"r{i}", list(range(1, 10)), SamplingParams(max_tokens=6), priority=i) for i in range(3)]
    for r in reqs:
        sched.add(r)
    written: dict[str, list[float]] = {r.request_id: [] for r in reqs}  # the value stored for each cached token
    parked_ever = set()
    for _step in range(40):
        batch = sched.schedule()
        parked_ever |= {r.request_id for r in batch.parked}
        for r, n in batch.work:  # the runner's part: append n tokens' keys/values, then advance
            assert r.slot is not None
            kv = arena.kv_batch([r.slot], n)
            assert kv is not None
            vals = [float(r.num_computed_tokens + t) for t in range(n)]
            x = torch.tensor(vals).view(1, n, 1, 1).expand(1, n, H_KV, D)
            for layer in (0, 1):
                kv.append(layer, x, x)
            kv.commit()
            written[r.request_id] += vals
            r.num_computed_tokens += n
            if not r.is_prefilling:
                r.output_ids.append(7)
        for r in list(sched.running):
            if len(r.output_ids) >= 6:  # the last sampled token is pending (not fed, not cached)
                assert r.slot is not None
                cached = arena.read(r.slot)[key_name(1)][0, :, 0, 0].tolist()
                assert cached == written[r.request_id] == [float(i) for i in range(r.num_computed_tokens)]
                sched.finish(r, Status.FINISHED_LENGTH)
        if not sched.has_work:
            break
    assert not sched.has_work and parked_ever, "the pool was meant to run short"
    assert arena.pool is not None and arena.pool.num_free == 7
