"""The search for the job that made an engine step fail (worker.quarantine), driven without a model: a step "fails"
while the group running holds a culprit, as the worker sees it."""

import itertools

import pytest

from worker.quarantine import Quarantine, halves


def search(jobs: list[str], fails, at: dict[str, int] | None = None) -> tuple[Quarantine, int]:
    """Run the search as the worker does; fails(group) says whether a step of that group raises. Each passing
    group lands one token past its marks. -> (the quarantine at its end, steps that failed)."""
    at = dict(at or dict.fromkeys(jobs, 0))
    q = Quarantine(dict(at))
    failures = 1  # the step that started it
    group = q.next_group()
    while group is not None:
        if fails(group):
            failures += 1
            q.failed({j: at[j] for j in group})
            group = q.next_group()
            continue
        for j in group:
            at[j] += 1
        assert q.passed(at.get)
        group = q.next_group()
    return q, failures


@pytest.mark.parametrize("size", [1, 2, 3, 8, 13, 32])
def test_one_culprit_is_found_and_no_other(size):
    jobs = [f"j{i}" for i in range(size)]
    for culprit in jobs:
        q, failures = search(jobs, lambda group, c=culprit: c in group)
        assert q.convicted == [culprit]
        assert sorted(q.cleared) == sorted(j for j in jobs if j != culprit)
        assert failures <= 2 + (size - 1).bit_length()  # bisection: a failed step per halving


def test_two_culprits_are_both_found():
    jobs = [f"j{i}" for i in range(10)]
    for a, b in itertools.combinations(jobs, 2):
        q, _ = search(jobs, lambda group, a=a, b=b: a in group or b in group)
        assert sorted(q.convicted) == sorted([a, b])
        assert len(q.cleared) == 8


def test_a_fault_that_needs_company_convicts_no_one():
    # a and b fail only together: apart, every group passes; only they were in groups that failed.
    q, _ = search(["a", "b", "c", "d"], lambda group: {"a", "b"} <= set(group))
    assert q.convicted == [] and sorted(q.cleared) == ["a", "b", "c", "d"]
    assert q.unexplained() == {"a", "b"}


def test_failures_a_convicted_job_explains_count_against_no_one():
    q, _ = search([f"j{i}" for i in range(8)], lambda group: "j5" in group)
    assert q.convicted == ["j5"] and q.unexplained() == set()


def test_a_group_passes_only_past_its_marks():
    q = Quarantine({"a": 5, "b": 0})
    assert q.next_group() == ["a"]
    assert not q.passed({"a": 5}.get)  # resumed where it stood: not past the fault yet
    assert q.passed({"a": 6}.get)
    assert q.next_group() == ["b"]
    assert q.passed(lambda job: None)  # it ended: it cannot fail any more
    assert q.next_group() is None and q.cleared == ["a", "b"]


def test_jobs_that_leave_are_no_longer_suspects():
    q = Quarantine(dict.fromkeys("abcd", 0))
    assert q.next_group() == ["a", "b"]
    q.drop(["a", "c"])
    assert q.running == ["b"] and q.suspects == ["b", "d"]
    q.drop(["b"])
    assert q.running == [] and q.next_group() == ["d"]


def test_halves():
    assert halves(["a"]) == [["a"]]
    assert halves(list("abcde")) == [["a", "b", "c"], ["d", "e"]]
