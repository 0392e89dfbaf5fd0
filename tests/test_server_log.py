"""The server-side properties read off a llama-server's -lv 4 log (harness.targets.server_log), on log lines written
as the pinned tree prints them: each property holds on a well-formed log and fails, with the line, on one that
breaks it. The same properties on real servers, each failing on a C++ mutant: tests/test_server_mutants.py."""

from __future__ import annotations

from harness.targets.server_log import LOG_PROPERTIES, CacheLog, LogProblem, busy_slot_touches

_T = "0.00.100.000 I srv        update: "


def _state(n: int, mib: float, limit: float, tokens: int, est: int, entries: list[tuple[int, int, float]]) -> str:
    lines = [f"{_T} - cache state: {n} prompts, {mib:.3f} MiB (limits: {limit:.3f} MiB, {tokens} tokens, {est} est)"]
    lines += [f"{_T}   - prompt 0x55{i:010x}: {t:7d} tokens, checkpoints: {c:2d}, {m:9.3f} MiB"
              for i, (t, c, m) in enumerate(entries)]  # fmt: skip
    return "\n".join(lines) + "\n0.00.100.001 I srv  get_availabl: prompt cache update took 0.02 ms\n"


def _scan(base: tuple[float, float], candidates: list[tuple[float, float]], found: tuple[float, float] | None) -> str:
    out = f"0.1 I srv          load:  - looking for better prompt, base f_keep = {base[0]:.3f}, f_sim = {base[1]:.3f}\n"
    for k, s in candidates:
        out += f"0.1 I srv  load:    - prompt with length     901, lcp =     226, f_keep = {k:.3f}, f_sim = {s:.3f}\n"
    if found is not None:
        out += f"0.1 I srv          load:  - found better prompt with f_keep = {found[0]:.3f}, f_sim = {found[1]:.3f}\n"
    return out


def _problems(text: str, ctx_checkpoints: int = 4) -> tuple[list[LogProblem], CacheLog]:
    log = CacheLog(ctx_checkpoints)
    return log.feed(text) + log.finish(), log


def test_a_well_formed_log_holds_every_property_and_counts_each() -> None:
    text = (
        "0.0 I slot create_check: id  1 | task 0 | created context checkpoint 2 of 4 (pos_min = 831, pos_max = 831, "
        "n_tokens = 832, size = 0.009 MiB)\n"
        + _scan((0.0, 0.0), [(0.251, 0.430), (0.9, 0.2)], (0.251, 0.430))
        + _state(2, 0.297, 1.0, 2048, 6070, [(901, 2, 0.148), (901, 2, 0.148)])
        + _state(2, 0.297, 1.0, 2048, 6070, [(901, 2, 0.148), (901, 2, 0.148)])  # nothing left, nothing came
        + _CLEAR.format(slot=1) + _CREATED.format(slot=1, k=1)
        + _TOKEN_EVICT.format(est=1000)  # 1802 tokens held: over est, so the oldest goes
        + f"{_T} - cache state: 1 prompts, 0.148 MiB (limits: 1.000 MiB, 2048 tokens, 6070 est)\n"
        + f"{_T}   - prompt 0x55{1:010x}:     901 tokens, checkpoints:  2,     0.148 MiB\n"
        + _FAILED_LOAD.format(slot=0)  # the load finds that entry and cannot restore it: kept, the slot cleared
        + f"{_T} - cache state: 1 prompts, 0.148 MiB (limits: 1.000 MiB, 2048 tokens, 6070 est)\n"
        + f"{_T}   - prompt 0x55{1:010x}:     901 tokens, checkpoints:  2,     0.148 MiB\n"
    )
    problems, log = _problems(text)
    assert problems == []
    assert all(log.checked[p] > 0 for p in LOG_PROPERTIES), log.checked


_TOKEN_EVICT = "0.4 W srv        update:  - cache token limit (2048, est: {est}) reached, removing oldest entry\n"
_CLEAR = "0.2 I slot prompt_clear: id  {slot} | task -1 | clearing prompt with 832 tokens\n"
_CREATED = ("0.3 I slot create_check: id  {slot} | task 5 | created context checkpoint {k} of 4 (pos_min = 63, "
            "pos_max = 63, n_tokens = 64, size = 0.009 MiB)\n")  # fmt: skip
_INVALIDATED = ("0.3 I slot update_slots: id  {slot} | task 5 | erased invalidated context checkpoint (pos_min = 831, "
                "pos_max = 831, n_tokens = 832, n_swa = 0, pos_next = 0, size = 0.009 MiB)\n")  # fmt: skip
_RESTORED = ("0.3 I slot update_slots: id  {slot} | task 5 | restored context checkpoint (pos_min = 831, "
             "pos_max = 831, n_tokens = 832, n_past = 832, size = 0.009 MiB)\n")  # fmt: skip
_LAUNCH = "0.25 I slot launch_slot_: id  {slot} | task -1 | sampler chain: logits -> dist\n"
#: a load that finds the one listed entry and cannot restore it (server-task.cpp:1834), then its slot cleared
_FAILED_LOAD = (
    "0.5 I srv          load:  - looking for better prompt, base f_keep = 0.002, f_sim = 0.002\n"
    "0.5 I srv          load:    - prompt with length     901, lcp =     500, f_keep = 0.998, f_sim = 0.909\n"
    "0.5 I srv          load:  - found better prompt with f_keep = 0.998, f_sim = 0.909\n"
    "0.5 E state_read_meta: failed to find 901 available cells in kv cache\n"
    "0.5 E srv          load: failed to restore state with size 134388\n"
    "0.5 W slot  prompt_load: id  {slot} | task -1 | failed to load prompt from cache\n"
    "0.5 I slot prompt_clear: id  {slot} | task -1 | clearing prompt with 401 tokens\n"
)
_ONE = (f"{_T} - cache state: 1 prompts, 0.148 MiB (limits: 8.000 MiB, 1024 tokens, 31269 est)\n"
        f"{_T}   - prompt 0x55{1:010x}:     901 tokens, checkpoints:  0,     0.148 MiB\n")  # fmt: skip


def test_a_failed_load_must_keep_its_entry_and_clear_its_slot() -> None:
    """``restore_failure`` at the cache state after a load that failed to restore (as the pinned server logs it
    when a unified KV has no room for the entry): kept and cleared holds; a slot left as it was fails, and so does
    the entry gone (with load_transfer, which counts it as a removal nobody logged)."""
    problems, log = _problems(_ONE + _FAILED_LOAD.format(slot=0) + _ONE)
    assert problems == [] and log.checked["restore_failure"] == 1, (problems, log.checked)
    kept_slot = _FAILED_LOAD.format(slot=0).replace("0.5 I slot prompt_clear: id  0 | task -1 | clearing prompt "
                                                    "with 401 tokens\n", "")  # fmt: skip
    problems, _ = _problems(_ONE + kept_slot + _ONE)
    assert [p.property for p in problems] == ["restore_failure"], problems
    assert "left slot 0 as it was: a failed load clears the slot" in problems[0].message
    empty = f"{_T} - cache state: 0 prompts, 0.000 MiB (limits: 8.000 MiB, 1024 tokens, 31269 est)\n"
    problems, _ = _problems(_ONE + _FAILED_LOAD.format(slot=0) + empty)
    assert "restore_failure" in [p.property for p in problems], problems
    assert any("left the cache: a failed load keeps it" in p.message for p in problems)


def test_the_idle_pass_touching_a_processing_slot_is_a_problem_and_a_busy_slot_named_by_id_the_finding() -> None:
    """``busy_slot_untouched`` over a whole log: a slot is processing from its launch to its release."""
    launch = "0.1 I slot launch_slot_: id  {s} | task {t} | processing task, is_child = 0\n"
    release = "0.2 I slot      release: id  {s} | task {t} | stop processing: n_tokens = 63, truncated = 0\n"
    idle = "0.1 I slot process_sing: id  {s} | task -1 | saving idle slot to prompt cache\n"
    by_id = "0.1 I slot get_availabl: id  {s} | task -1 | selected slot by id (0)\n"
    fine = launch.format(s=0, t=1) + idle.format(s=1) + release.format(s=0, t=1) + idle.format(s=0)
    assert busy_slot_touches(fine) == (2, 0, [])
    finding = launch.format(s=0, t=1) + by_id.format(s=0) + release.format(s=0, t=1)
    assert busy_slot_touches(finding) == (0, 1, [])
    saves, _, touched = busy_slot_touches(launch.format(s=0, t=1) + idle.format(s=0))
    assert saves == 1 and len(touched) == 1 and "saved slot 0 while it was processing" in touched[0]


def test_a_cleared_slot_that_kept_its_checkpoints_fails_cleared_checkpoints() -> None:
    """A clear then an invalidation or a restore of that slot's checkpoint, or a creation numbered above 1: the
    clear left checkpoints behind. Another slot's events, or a load into the slot first, say nothing."""
    for after in (_INVALIDATED.format(slot=1), _RESTORED.format(slot=1), _CREATED.format(slot=1, k=3)):
        problems, log = _problems(_CLEAR.format(slot=1) + after)
        assert [p.property for p in problems] == ["cleared_checkpoints"], problems
        assert "slot 1 was cleared at log line 1" in problems[0].message
        assert log.checked["cleared_checkpoints"] == 1
    other, log = _problems(_CLEAR.format(slot=1) + _INVALIDATED.format(slot=0) + _CREATED.format(slot=1, k=1))
    assert other == [] and log.checked["cleared_checkpoints"] == 1
    load = _scan((0.0, 0.0), [(0.9, 0.9)], (0.9, 0.9))
    loaded, log = _problems(_CLEAR.format(slot=1) + load + _LAUNCH.format(slot=1) + _RESTORED.format(slot=1))
    assert loaded == [] and log.checked["cleared_checkpoints"] == 0  # the entry it loaded brought checkpoints


def test_over_the_byte_limit_over_the_token_limit_and_an_entry_alone_over_it_fail_limit() -> None:
    over = _problems(_state(2, 1.2, 1.0, 2048, 6070, [(901, 2, 0.6), (901, 2, 0.6)]))[0]
    assert [p.property for p in over] == ["limit"] and "1.200 MiB over its limit 1.000 MiB" in over[0].message
    tokens = _problems(_state(2, 0.46, 0.0, 1024, 1024, [(901, 0, 0.23), (901, 0, 0.23)]))[0]
    assert [p.property for p in tokens] == ["limit"] and "1802 tokens over its token limit 1024" in tokens[0].message
    rounding = _problems(_state(1, 1.0004, 1.0, 2048, 6070, [(901, 2, 1.0004)]))[0]
    assert rounding == []  # within the log's rounding


def test_a_total_that_is_not_the_sum_of_the_entries_fails_accounting() -> None:
    problems = _problems(_state(2, 0.279, 1.0, 2048, 6070, [(901, 2, 0.148), (901, 2, 0.148)]))[0]
    assert [p.property for p in problems] == ["accounting"]
    assert "it lists 2 entries of 0.296 MiB" in problems[0].message
    count = _problems(_state(3, 0.296, 1.0, 2048, 6070, [(901, 2, 0.148), (901, 2, 0.148)]))[0]
    assert [p.property for p in count] == ["accounting"]


def test_a_checkpoint_over_the_cap_fails_checkpoint_lists() -> None:
    created = "0.0 I slot create_check: id  0 | task 3 | created context checkpoint 3 of 2 (pos_min = 1, pos_max = 1)\n"
    problems = _problems(created, ctx_checkpoints=2)[0]
    assert [p.property for p in problems] == ["checkpoint_lists"] and "3 of 2" in problems[0].message
    listed = _problems(_state(1, 0.148, 1.0, 2048, 6070, [(901, 3, 0.148)]), ctx_checkpoints=2)[0]
    assert [p.property for p in listed] == ["checkpoint_lists"]
    other_cap = _problems(created.replace("3 of 2", "1 of 8"), ctx_checkpoints=2)[0]
    assert [p.property for p in other_cap] == ["checkpoint_lists"]  # not the server's --ctx-checkpoints


def test_a_load_other_than_upstreams_scan_fails_load_choice() -> None:
    # f_keep 0.251 clears the 0.25 floor and beats the slot on both: upstream takes it; the server took nothing
    skipped = _problems(_scan((0.0, 0.0), [(0.251, 0.430)], None) + _state(0, 0.0, 1.0, 2048, 6070, []))[0]
    assert [p.property for p in skipped] == ["load_choice"]
    assert "load took nothing where upstream's scan takes the entry with f_keep 0.251" in skipped[0].message
    # below the floor: upstream takes nothing; a server that took it is wrong too
    took = _problems(_scan((0.0, 0.0), [(0.249, 0.430)], (0.249, 0.430)))[0]
    assert [p.property for p in took] == ["load_choice"]
    # the first that beats the best so far on both, front to back, then only a better one
    later = _scan((0.1, 0.1), [(0.5, 0.5), (0.6, 0.4), (0.7, 0.7)], (0.7, 0.7))
    assert _problems(later)[0] == []
    first = _scan((0.1, 0.1), [(0.5, 0.5), (0.6, 0.4), (0.7, 0.7)], (0.5, 0.5))
    assert [p.property for p in _problems(first)[0]] == ["load_choice"]


def test_an_update_that_evicts_for_size_fails_alloc_eviction_unless_an_allocation_failure_lowered_the_limit() -> None:
    evict = "0.1 W srv        update:  - cache size limit reached, removing oldest entry (size = 0.148 MiB)\n"
    problems = _problems(evict)[0]
    assert [p.property for p in problems] == ["alloc_eviction"]
    assert "alloc saved without making room" in problems[0].message
    lowered = "0.1 W srv         alloc:  - cache size limit reduced to 0.400 MiB\n" + evict
    assert _problems(lowered)[0] == []


def test_lines_arrive_in_pieces_and_are_read_once() -> None:
    text = _state(2, 0.279, 1.0, 2048, 6070, [(901, 2, 0.148), (901, 2, 0.148)])
    log = CacheLog(4)
    half = len(text) // 2
    first = log.feed(text[:half])  # a partial line is not read
    rest = log.feed(text) + log.feed(text) + log.finish()  # the whole log again: nothing read twice
    assert first == [] and [p.property for p in rest] == ["accounting"]
    assert log.checked["accounting"] == 1


def _listing(ids: list[str]) -> str:
    head = f"{_T} - cache state: {len(ids)} prompts, {0.1 * len(ids):.3f} MiB"
    lines = [head + " (limits: 8.000 MiB, 2048 tokens, 99 est)"]
    lines += [f"{_T}   - prompt {i}:       9 tokens, checkpoints:  0,     0.100 MiB" for i in ids]
    return "\n".join(lines) + "\n0.1 I srv  get_availabl: prompt cache update took 0.02 ms\n"


_SAVE = "0.1 I srv   prompt_save:  - saving prompt with length 9, total state size = 0.100 MiB (draft: 0.000 MiB)\n"
_LOAD = "0.1 I srv          load:  - found better prompt with f_keep = 0.900, f_sim = 0.900\n"


def test_entries_leave_the_cache_only_by_a_logged_removal_and_appear_only_by_a_save() -> None:
    # a save adds B, a load moves A into the slot: A leaves, B appears
    ok = _listing(["0xa"]) + _SAVE + _LOAD + _listing(["0xb"])
    problems, log = _problems(ok)
    assert problems == [] and log.checked["load_transfer"] == 1
    # the same in b9093's words ("sim" before upstream named it "f_sim"): the load is still a removal
    older = _LOAD.replace("f_sim", "sim")
    assert _problems(_listing(["0xa"]) + _SAVE + older + _listing(["0xb"]))[0] == []
    # and its scan, which lists no candidates: which entry it took cannot be read (load_choice not counted)
    looking = "0.1 I srv          load:  - looking for better prompt, base f_keep = 0.100, sim = 0.200\n"
    problems, log = _problems(_listing(["0xa"]) + _SAVE + looking + older + _listing(["0xb"]))
    assert problems == [] and log.checked["load_choice"] == 0 and log.checked["load_transfer"] == 1
    # the same, the freed address of A reused by B's save: no entry seems to leave or appear
    assert _problems(_listing(["0xa"]) + _SAVE + _LOAD + _listing(["0xa"]))[0] == []
    # a load whose entry stays in the cache
    kept = _problems(_listing(["0xa"]) + _SAVE + _LOAD + _listing(["0xa", "0xb"]))[0]
    assert [p.property for p in kept] == ["load_transfer"]
    assert "the log shows 1 removals (obsolete, load, eviction) but 0 entries left the cache" in kept[0].message
    # an entry gone without a logged removal, and one appearing without a save
    gone = _problems(_listing(["0xa", "0xb"]) + _listing(["0xb"]))[0]
    # (the replay of the cache's order sees the same: 0xa gone though nothing removed it, alloc_eviction)
    assert [p.property for p in gone] == ["load_transfer", "alloc_eviction"]
    assert "1 entries left the cache where the log shows 0" in gone[0].message
    born = _problems(_listing(["0xa"]) + _listing(["0xa", "0xc"]))[0]
    assert [p.property for p in born] == ["load_transfer", "alloc_eviction"]
    assert "1 entries appeared where 0 saves" in born[0].message


def test_a_line_of_an_http_thread_inside_a_states_list_is_passed_over() -> None:
    text = _state(2, 0.297, 1.0, 2048, 6070, [(901, 2, 0.148), (901, 2, 0.148)])
    first, rest = text.split("\n", 1)
    interleaved = first + "\n0.1 I srv  server_strea: conv_id= (empty=1)\n" + rest
    assert _problems(interleaved)[0] == []  # not "the cache state says 2 prompts; it lists 0 entries"


def test_an_entry_that_is_a_prefix_of_another_fails_no_prefix_entries() -> None:
    scan = (
        "0.1 I srv          load:  - looking for better prompt, base f_keep = 0.000, f_sim = 0.000\n"
        "0.1 I srv  load:    - prompt with length    1000, lcp =     200, f_keep = 0.200, f_sim = 0.667\n"
        "0.1 I srv  load:    - prompt with length     200, lcp =     200, f_keep = 1.000, f_sim = 0.667\n"
    )
    problems, log = _problems(scan + "0.1 I srv   update: - cache state: 0 prompts, 0.000 MiB (limits: 8.000 MiB, "
                              "2048 tokens, 6070 est)\n")  # fmt: skip
    prefix = [p for p in problems if p.property == "no_prefix_entries"]
    assert len(prefix) == 1 and "an entry of 200 tokens that is a prefix of another of 1000" in prefix[0].message
    # the same lengths, the shorter one not matched to its end: no relation between them
    fine = _problems(scan.replace("lcp =     200, f_keep = 1.000", "lcp =     150, f_keep = 0.750"))[0]
    assert not [p for p in fine if p.property == "no_prefix_entries"]
    assert log.checked["no_prefix_entries"] == 1


def test_evictions_take_the_oldest_entries_and_only_as_many_as_needed() -> None:
    """alloc_eviction replays the cache's order: a save's make-room evictions pop the oldest, then the new entry is
    appended; a state listing another order, or an eviction the cache and the new entry did not need, fails."""
    room = "0.1 W srv         alloc:  - making room for prompt cache entry, removing oldest entry (size = 0.100 MiB)\n"
    state = lambda ids, mib, limit: (  # noqa: E731
        f"{_T} - cache state: {len(ids)} prompts, {mib * len(ids):.3f} MiB "
        f"(limits: {limit:.3f} MiB, 2048 tokens, 99 est)\n"
        + "".join(f"{_T}   - prompt {i}:       9 tokens, checkpoints:  0,     {mib:.3f} MiB\n" for i in ids)
        + "0.1 I srv  get_availabl: prompt cache update took 0.02 ms\n")
    ok = state(["0xa", "0xb"], 0.1, 0.2) + _SAVE + room + state(["0xb", "0xc"], 0.1, 0.2)
    problems, log = _problems(ok)
    assert problems == [] and log.checked["alloc_eviction"] >= 1
    newest = _problems(state(["0xa", "0xb"], 0.1, 0.2) + _SAVE + room + state(["0xa", "0xc"], 0.1, 0.2))[0]
    assert [p.property for p in newest] == ["alloc_eviction"]
    assert "where removing the oldest entries first" in newest[0].message and "['0xb', 'new']" in newest[0].message
    needless = _problems(state(["0xa", "0xb"], 0.1, 0.4) + _SAVE + room + state(["0xb", "0xc"], 0.1, 0.4))[0]
    assert [p.property for p in needless] == ["alloc_eviction"] and "fit the limit 0.400 MiB" in needless[0].message


def test_an_update_that_evicts_for_tokens_below_its_estimate_fails_update_eviction() -> None:
    two = _state(2, 0.297, 1.0, 2048, 6070, [(901, 2, 0.148), (901, 2, 0.148)])
    one = (f"{_T} - cache state: 1 prompts, 0.148 MiB (limits: 1.000 MiB, 2048 tokens, 6070 est)\n"
           f"{_T}   - prompt 0x55{1:010x}:     901 tokens, checkpoints:  2,     0.148 MiB\n")  # fmt: skip
    fine, log = _problems(two + _TOKEN_EVICT.format(est=1000) + one)
    assert fine == [] and log.checked["update_eviction"] == 1
    needless, _ = _problems(two + _TOKEN_EVICT.format(est=5000) + one)  # 1802 <= 5000: nothing to evict
    assert [p.property for p in needless] == ["update_eviction"], needless
    assert "though the cache held 1802 <= 5000 tokens" in needless[0].message


def test_a_load_that_failed_to_restore_keeps_its_entry_and_is_no_removal() -> None:
    """``load`` logs the entry it found, then "failed to restore state" and returns before erasing it
    (server-task.cpp:1833): the entry staying is no load_transfer problem; one that left anyway is."""
    failed = "0.1 E srv          load: failed to restore state with size 311296\n"
    both = [(901, 2, 0.148), (901, 2, 0.148)]
    kept = _state(2, 0.297, 1.0, 2048, 6070, both) + _scan((0.0, 0.0), [(0.9, 0.5), (0.1, 0.1)], (0.9, 0.5)) + failed
    problems, log = _problems(kept + _state(2, 0.297, 1.0, 2048, 6070, both))
    assert problems == [] and log.checked["load_transfer"] == 1 and log.checked["alloc_eviction"] >= 1, problems
    gone, _ = _problems(kept + _state(1, 0.148, 1.0, 2048, 6070, both[:1]))
    assert sorted(p.property for p in gone) == ["alloc_eviction", "load_transfer"], gone
