"""The prompts of `pagedq bench -w spec` (bench.speculative): a ~1,000-token report and three grounded tasks on it,
a JSON extraction from it under a schema, and an open-ended chat prompt with nothing in it to copy."""

from __future__ import annotations

DOC = """The Harbor Bridge Renovation Project: Annual Report

In March, the city council approved the renovation of the Harbor Bridge, a steel arch bridge that opened in 1932 and
carries about 48,000 vehicles a day between the old town and the northern districts. The project has three phases.
The first phase, which ran from April to September, replaced the expansion joints and the drainage system on the
southern approach. The second phase, which started in October, is replacing the concrete deck of the main span, one
lane at a time, so that traffic can keep crossing the bridge in both directions. The third phase, planned for next
year, will repaint the steel arch and install new lighting along the pedestrian walkway.

The total budget of the project is 62 million euros. The national transport fund pays 40 million euros, the regional
government pays 12 million euros, and the city pays the remaining 10 million euros. By the end of the year the project
had spent 21 million euros, which is 2 million euros less than planned, mainly because the replacement of the
expansion joints took fewer working days than expected.

The main contractor is Nordbau Infrastructure, which won the tender in February against four other companies. Nordbau
employs about 120 workers on the site, most of them working in two shifts. To reduce noise for the residents of the
old town, no heavy machinery is used between 10 p.m. and 6 a.m., and the loudest work, the removal of the old deck, is
done on weekdays only.

Traffic on the bridge has been reduced from four lanes to two lanes since October. The average travel time across the
bridge during the morning rush hour went up from 6 minutes to 14 minutes. To compensate, the city added two new bus
lines, the 41 and the 42, which cross the river on the eastern ferry, and it extended the opening hours of the ferry
until midnight. The number of passengers on the ferry increased by 35 percent between September and December.

The renovation also changes the bridge itself. The new deck is made of prefabricated concrete slabs, each 12
meters long and 4 meters wide, which are cast in a factory in the harbor district and brought to the site by barge at
night. Each slab weighs about 90 tonnes and is lifted into place by a floating crane. The new deck is 30 centimeters
thinner than the old one, which reduces the weight on the steel arch by about 15 percent. The new drainage system
collects the rain water from the deck in a pipe under the walkway and leads it to a treatment basin on the southern
bank, instead of letting it fall into the river as before.

The project also has an environmental program. A team of biologists counted the birds nesting under the bridge before
the work started and found 14 pairs of peregrine falcons and about 300 pairs of swallows. The contractor moved the
work on the northern pillars to the autumn, after the nesting season, and installed 40 nest boxes on the old customs
house near the bridge. The dust from the removal of the old deck is caught by nets under the span, and the water of
the river is tested every week for oil and cement. So far, all tests have been below the legal limits.

Several problems occurred during the year. In July, inspectors found corrosion in two of the steel hangers that hold
the deck, which was not expected in the original plan. Both hangers were replaced in August, at a cost of 1.4 million
euros. In November, a storm stopped the work for nine days. The project is still expected to finish on time, in
October of next year, because the contractor added a third shift during the winter months.

The next steps are the completion of the deck on the northern half of the main span by April, the reopening of all
four lanes in May, and the start of the repainting of the arch in June. The city will publish a progress report every
three months, and residents can follow the work on the project's website, which shows live images from two cameras
mounted on the arch."""

# Grounded tasks: much of each answer is copied from the report, where prompt lookup drafts well.
TASKS = {
    "summarize": "Summarize the report above. Keep the key facts and numbers: the phases, the budget and who pays it, "
                 "the contractor, the traffic changes, the problems, and the next steps.",
    "rewrite": "Rewrite the report above with small changes: say \"the crossing\" instead of \"the bridge\" and "
               "\"the firm\" instead of \"the contractor\", and keep every other sentence exactly as it is.",
    "extract": "List the facts of the report above that contain a number, one per line, each line starting "
               "with \"- \" and quoting the report's own words.",
}

JSON_TASK = "Extract the project's key facts from the report above as JSON."

# The record JSON_TASK asks for: bounded, so that it ends within the workload's tokens.
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "bridge": {"type": "string", "maxLength": 40},
        "opened": {"type": "integer"},
        "vehicles_per_day": {"type": "integer"},
        "budget_million_eur": {"type": "number"},
        "funders": {
            "type": "array", "maxItems": 3,
            "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                                       "million_eur": {"type": "number"}},
                      "required": ["name", "million_eur"], "additionalProperties": False},
        },
        "contractor": {"type": "string", "maxLength": 40},
        "workers": {"type": "integer"},
        "problems": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 80}},
        "finish": {"type": "string", "maxLength": 30},
    },
    "required": ["bridge", "opened", "vehicles_per_day", "budget_million_eur", "funders", "contractor", "workers",
                 "problems", "finish"],
    "additionalProperties": False,
}

# Open-ended: nothing in the prompt to copy, so drafts are mostly wrong and speculation must not cost.
CHAT = ("Write a short story about a lighthouse keeper who finds a message in a bottle, with a surprising ending. "
        "Make the characters and the place vivid.")
