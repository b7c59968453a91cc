"""Speculation under a constraint (issue 42): the grammar's forced tokens drafted first (jump-forward), the n-gram's
guess after them cut where the grammar refuses it, and verify rows masked by the matcher after each draft prefix.
Greedy output with speculation equals greedy without, token for token."""

import json
import re

import jsonschema
import numpy as np
import pytest
from test_speculative import HITS, pair, run, same

from engine import Constraint, SamplingParams
from engine.sequence import Sequence
from engine.speculative.constrained import ConstrainedProposer

# Long fixed keys: most of the output is text the grammar forces. Values are bounded (a random model in a free
# string rarely closes it).
SCHEMA = {
    "type": "object",
    "properties": {
        "customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 999},
        "invoice_payment_status_code": {"enum": ["paid_in_full", "partially_paid", "overdue"]},
        "requires_manual_review_flag": {"type": "boolean"},
    },
    "required": ["customer_account_identifier", "invoice_payment_status_code", "requires_manual_review_flag"],
    "additionalProperties": False,
}
REGEX = r"INVOICE-[0-9]{3}-(PAID|OVERDUE)"
CHOICES = ["the invoice was paid in full", "the invoice is overdue by thirty days"]
PROMPTS = ["Extract the invoice fields as JSON.", "Invoice code:", "Status:"]


def greedy(kind, spec, max_tokens: int = 80) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, constraint=Constraint(kind, spec))


PARAMS = [greedy("json_schema", SCHEMA), greedy("regex", REGEX), greedy("choice", CHOICES)]


def fits(i: int, out) -> bool:
    """Whether the output of PARAMS[i] parses as its constraint says: its matcher ended in a complete grammar."""
    if i == 0:
        jsonschema.validate(json.loads(out.text), SCHEMA)
        return True
    return bool(re.fullmatch(REGEX, out.text)) if i == 1 else out.text in CHOICES


def check_outputs(outs) -> None:
    assert all(o.finish_reason == "stop" for o in outs[:3]), [o.text for o in outs]
    assert all(fits(i, o) for i, o in enumerate(outs[:3])), [o.text for o in outs]


@pytest.fixture(scope="module")
def engines(make_engine):
    return pair(make_engine, block_size=4)


def matcher(engine, kind, spec):
    return engine.grammars.compile(Constraint(kind, spec)).result().new_matcher()


class Fixed:
    """An inner proposer that guesses the same tokens for everyone, and records what it was asked."""

    def __init__(self, guess: list[int]) -> None:
        self.guess = guess
        self.asked: list[tuple[list[int], int]] = []

    def propose(self, wants):
        self.asked += [(list(seq.token_ids), k) for seq, k in wants]
        return [self.guess[:k] for _, k in wants]

    def finished(self, seq):
        pass


def test_forced_tokens_come_first_and_guesses_stop_where_the_grammar_refuses(engines):
    _, on = engines
    tok = on.tokenizer
    text = tok.encode('{"customer_account_identifier":12,')
    seq = Sequence("c", [1, 2, 3], SamplingParams(temperature=0))
    seq.matcher = matcher(on, "json_schema", SCHEMA)
    forced = seq.matcher.compute_ff_tokens()
    assert len(forced) >= 3 and text[: len(forced)] == forced  # '{"customer_account_identifier' is forced
    plain = Sequence("p", [1, 2, 3], SamplingParams(temperature=0))
    # The guess continues the forced tokens, and goes wrong after "12,": an EOS the grammar refuses there.
    guess = text[len(forced):] + [next(iter(on.eos_token_ids))] + text[:2]
    inner = Fixed(guess)
    proposer = ConstrainedProposer(inner)
    drafts = proposer.propose([(seq, 40), (plain, 3), (seq, 2)])
    assert drafts == [text, guess[:3], forced[:2]]
    # The inner proposer saw the constrained sequence with its forced tokens; the unconstrained one as it is.
    assert inner.asked == [([1, 2, 3, *forced], 40 - len(forced)), ([1, 2, 3], 3)]
    assert seq.token_ids == [1, 2, 3] and plain.token_ids == [1, 2, 3]
    assert seq.matcher.compute_ff_tokens() == forced  # the matcher has not moved


def test_verify_masks_are_the_matchers_after_each_draft_prefix(engines):
    _, on = engines
    m = matcher(on, "regex", REGEX)
    draft = on.tokenizer.encode("INVOICE-123-P")
    bits = on.grammars.fill_verify([(m, draft)])
    assert bits.shape[0] == 1 + len(draft)
    step = m.deep_copy()
    for j in range(len(draft) + 1):
        assert np.array_equal(bits[j], on.grammars.fill([step])[0]), j
        if j < len(draft):
            assert step.consume_token(draft[j])
    assert np.array_equal(on.grammars.fill([m])[0], bits[0])  # the matcher ends where it was
    # A refused draft token: the rows after it allow everything (the row before rejects it: they never land).
    bits = on.grammars.fill_verify([(m, [draft[0], on.tokenizer.encode("zz")[0], draft[1]])])
    assert (bits[2:] == -1).all() and not (bits[1] == -1).all()


def test_constrained_greedy_with_speculation_equals_greedy_without(engines):
    off, on = engines
    before = on.speculation.proposed, on.speculation.accepted
    check_outputs(same(off, on, PROMPTS, PARAMS))
    proposed, accepted = on.speculation.proposed - before[0], on.speculation.accepted - before[1]
    # Forced runs are accepted: at a forced position the mask leaves the target that token alone.
    assert proposed > 20 and accepted >= 0.8 * proposed, (proposed, accepted)


def test_each_constraint_alone_lands_its_forced_runs_in_fewer_steps(engines):
    off, on = engines
    for prompt, params in zip(PROMPTS, PARAMS):
        steps = off.times.steps, on.times.steps
        (want,) = same(off, on, [prompt], params)
        assert want.finish_reason == "stop" and fits(PARAMS.index(params), want), want.text
        assert on.times.steps - steps[1] < off.times.steps - steps[0], prompt


def test_constrained_beside_plain_rows_and_late_joiners(engines):
    off, on = engines
    plain = SamplingParams(max_tokens=30, temperature=0)
    sampled = SamplingParams(max_tokens=20, temperature=0.8, seed=3, constraint=Constraint("regex", REGEX))
    prompts = [*PROMPTS, HITS[0], HITS[1], "Code:"]
    params = [*PARAMS, plain, plain, sampled]
    got = same(off, on, prompts, params)
    check_outputs(got)
    assert re.fullmatch(REGEX, got[5].text)
    steps = on.speculation.steps
    check_outputs(same(off, on, prompts, params, late=3))  # constrained requests join a batch with drafts
    assert on.speculation.steps > steps


@pytest.mark.slow
def test_preemption_with_constraints_changes_nothing(make_engine):
    from preemptions import record_preemptions

    # 14 blocks of 4 tokens hold the longest request, not the two longest at once: preemption must happen.
    off, on = pair(make_engine, num_kv_blocks=14, block_size=4, max_num_batched_tokens=64)
    preempted = record_preemptions(on)
    outs = same(off, on, PROMPTS + HITS[:1], PARAMS + [SamplingParams(max_tokens=30, temperature=0)])
    check_outputs(outs)
    assert preempted and on.speculation.accepted > 0
    assert run(on, PROMPTS, PARAMS)  # and the pool is whole again (run checks it)


@pytest.mark.slow
def test_smollm2_extraction_is_the_same(smollm2, make_engine):
    """The real model extracting facts under a schema: its keys are forced, its values copied from the prompt."""
    on = make_engine("smollm2-135m-instruct", max_num_seqs=16, num_kv_blocks=512, quantization="none",
                     speculative="ngram")
    doc = ("The Harbor Bridge opened in 1932 and carries 48,000 vehicles a day. Its renovation costs 62 million "
           "euros. Nordbau Infrastructure is the contractor.")
    schema = {"type": "object", "additionalProperties": False,
              "properties": {"bridge_name": {"type": "string", "maxLength": 40},
                             "year_opened": {"type": "integer"}, "vehicles_per_day": {"type": "integer"},
                             "renovation_cost_million_euros": {"type": "number"},
                             "main_contractor_name": {"type": "string", "maxLength": 40}}}
    schema["required"] = list(schema["properties"])
    prompt = smollm2.apply_chat_template([{"role": "user", "content": doc + "\n\nExtract the facts as JSON."}])
    params = SamplingParams(max_tokens=120, temperature=0, constraint=Constraint("json_schema", schema))
    (want,) = smollm2.generate([prompt], params)
    (got,) = on.generate([prompt], params)
    assert got.token_ids == want.token_ids and got.finish_reason == "stop"
    jsonschema.validate(json.loads(got.text), schema)
    assert on.speculation.accepted >= 0.5 * on.speculation.proposed > 0
