"""The change differential's comparison of two answers (``change.difference``), on hand-made answers and log
lines: no server, no model (the default tier). The gate on real trees is in ``test_user_trees.py``."""

from __future__ import annotations

from harness.backends.llama_server.change import EVENTS, Answer, Event, difference, parse_events
from harness.targets.server_log import LogProblem

# the lines as the pinned tree logs them at -lv 4 (tools/server/server-context.cpp, server-task.cpp at 0c1e570)
LOG = """\
slot update_slots: id  0 | task 0 | created context checkpoint 1 of 8 (pos_min = 0, pos_max = 63, n_tokens = 64, size = 0.500 MiB)
srv  prompt_save:  - saving prompt with length 70, total state size = 2.125 MiB (draft: 0.000 MiB)
srv        alloc:  - making room for prompt cache entry, removing oldest entry (size = 1.750 MiB)
srv         load:  - found better prompt with f_keep = 0.914, f_sim = 0.500
srv       update:  - cache token limit (8192, est: 9000) reached, removing oldest entry (size = 3.000 MiB)
slot update_slots: id  0 | task 3 | restored context checkpoint (pos_min = 0, pos_max = 63, n_tokens = 64, n_past = 64, size = 0.500 MiB)
slot update_slots: id  0 | task 3 | erased invalidated context checkpoint (pos_min = 0, pos_max = 90, n_tokens = 91, n_swa = 0, pos_next = 64, size = 0.500 MiB)
slot update_slots: id  0 | task 3 | erasing context checkpoint too close to an earlier one (pos_min = 1, pos_max = 2, n_tokens = 3, size = 0.1 MiB)
slot update_slots: id  0 | task 3 | erasing old context checkpoint (pos_min = 0, pos_max = 31, n_tokens = 32, size = 0.250 MiB)
"""  # noqa: E501


def _answer(*records: Event) -> Answer:
    return Answer(0, 64, (5, 6), None, records)


def _created(pos_max: int, n_tokens: int, number: int = 1) -> Event:
    values = {"number": number, "of": 8, "pos_min": 0, "pos_max": pos_max, "n_tokens": n_tokens, "size": "0.500"}
    return Event("checkpoints_created", tuple((k, str(v)) for k, v in values.items()))


def test_each_event_line_is_parsed_with_its_numbers() -> None:
    got = parse_events(LOG)
    assert [e.name for e in got] == [
        "checkpoints_created", "saves", "evictions", "cache_loads", "evictions", "checkpoints_restored",
        "checkpoints_invalidated", "checkpoints_erased",
    ]  # fmt: skip
    assert got[0] == _created(63, 64)
    assert dict(got[1].values) == {"length": "70", "size": "2.125", "draft": "0.000"}
    assert dict(got[2].values) == {"size": "1.750"}
    assert dict(got[3].values) == {"f_keep": "0.914", "f_sim": "0.500"}
    assert dict(got[4].values) == {"size": "3.000"}  # the token limit's numbers precede the words: not the event's
    assert dict(got[5].values)["n_past"] == "64"
    assert dict(got[6].values)["pos_next"] == "64"
    assert dict(got[7].values) == {"pos_min": "0", "pos_max": "31", "n_tokens": "32", "size": "0.250"}
    assert _answer(*got).events == (
        ("evictions", 2), ("saves", 1), ("cache_loads", 1), ("checkpoints_created", 1),
        ("checkpoints_restored", 1), ("checkpoints_invalidated", 1), ("checkpoints_erased", 1),
    )  # fmt: skip
    assert [name for name, _ in _answer().events] == list(EVENTS)


def test_the_same_events_are_no_difference() -> None:
    assert difference(_answer(_created(63, 64)), _answer(_created(63, 64))) is None
    assert difference(_answer(*parse_events(LOG)), _answer(*parse_events(LOG))) is None


def test_a_checkpoint_at_other_positions_is_a_difference_though_the_counts_agree() -> None:
    tree = _answer(_created(31, 32), _created(63, 64, 2))
    base = _answer(_created(31, 32), _created(127, 128, 2))
    assert tree.events == base.events
    assert difference(tree, base) == (
        "the logs show checkpoints_created (2 of 2): TREE pos_max 63 n_tokens 64 where BASE pos_max 127 n_tokens 128"
    )


def test_a_save_of_another_length_and_a_load_with_other_fractions_are_differences() -> None:
    lines = LOG.splitlines()
    changed = LOG.replace("with length 70", "with length 71").replace("f_sim = 0.500", "f_sim = 0.600")
    msg = difference(_answer(*parse_events(changed)), _answer(*parse_events(LOG)))
    assert msg == "the logs show saves (1 of 1): TREE length 71 where BASE length 70"  # the first in the log
    only_load = "\n".join([*lines[:3], lines[3].replace("0.500", "0.600")])
    msg = difference(_answer(*parse_events(only_load)), _answer(*parse_events("\n".join(lines[:4]))))
    assert msg == "the logs show cache_loads (1 of 1): TREE f_sim 0.600 where BASE f_sim 0.500"


def test_other_counts_are_reported_as_counts() -> None:
    msg = difference(_answer(_created(63, 64)), _answer(_created(63, 64), _created(127, 128, 2)))
    assert msg == "the logs show checkpoints_created: TREE 1 where BASE 2"


def test_a_field_one_side_does_not_log_is_not_a_difference() -> None:
    older = Event("saves", (("length", "70"), ("size", "2.125")))  # a tree whose line has no "(draft: ...)"
    newer = Event("saves", (("length", "70"), ("size", "2.125"), ("draft", "0.000")))
    assert difference(_answer(older), _answer(newer)) is None


def test_the_answer_still_shows_its_counts() -> None:
    a = _answer(_created(63, 64), _created(127, 128, 2))
    assert a.describe() == "slot 0 cache_n 64 generated [5, 6] (checkpoints_created 2)"


def test_a_server_side_property_broken_on_trees_log_only_is_the_changes() -> None:
    broken = LogProblem("checkpoint_lists", "log line 7: created context checkpoint 3 of 2 with --ctx-checkpoints 2")
    tree = Answer(0, 64, (5, 6), None, (), None, (broken,))
    said = difference(tree, _answer())
    assert said is not None and said.startswith("TREE's log breaks checkpoint_lists where BASE's holds it: log line 7")
    base = Answer(0, 64, (5, 6), None, (), None, (broken,))
    assert difference(tree, base) is None  # broken on both sides: upstream's, not the change's
